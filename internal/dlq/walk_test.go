package dlq_test

import (
	"context"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/dlq"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/wire"
)

// rig is a dead-letter queue of the test's own, with a channel to fill and
// read it behind the walks' backs.
type rig struct {
	t  *testing.T
	q  *dlq.Queue
	ch *amqp.Channel
}

func newRig(t *testing.T) *rig {
	t.Helper()
	url := testenv.AMQPURL()
	topo := broker.TopologyFor(testenv.Queue(t, url), 0)
	t.Cleanup(func() { _ = sandbox.DeleteQueue(url, topo.DeadLetterQueue) })
	conn, err := amqp.Dial(url)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, topo.Declare(ch))
	q, err := dlq.Open(context.Background(), url, topo)
	require.NoError(t, err)
	t.Cleanup(func() { q.Close() })
	return &rig{t: t, q: q, ch: ch}
}

// put publishes dead letters with these message IDs, confirmed.
func (r *rig) put(ids ...string) {
	r.t.Helper()
	conn, err := amqp.Dial(testenv.AMQPURL())
	require.NoError(r.t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(r.t, err)
	require.NoError(r.t, ch.Confirm(false))
	for _, id := range ids {
		dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), "", r.q.DLQ, true, false, amqp.Publishing{
			MessageId: id, Body: []byte("body of " + id), DeliveryMode: amqp.Persistent,
			Headers: amqp.Table{wire.HeaderReason: "handler_failed"},
		})
		require.NoError(r.t, err)
		require.True(r.t, dc.Wait())
	}
}

// walk visits the queue, keeping everything, and returns the IDs in order.
func (r *rig) walk() []string {
	r.t.Helper()
	var ids []string
	_, err := r.q.Walk(context.Background(), func(m dlq.Message) (dlq.Verdict, error) {
		ids = append(ids, m.D.MessageId)
		return dlq.Keep, nil
	})
	require.NoError(r.t, err)
	return ids
}

// TestAWalkActsOnlyOnWhatWasThereWhenItBegan: while a purge runs, another
// tool takes a dead letter and holds it, and a new one arrives. Before, the
// walk's snapshot was a count, and the purge deleted the newcomer in place
// of the held one.
func TestAWalkActsOnlyOnWhatWasThereWhenItBegan(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	r.put("A", "B", "C")
	other, err := amqp.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	defer other.Close()
	otherCh, err := other.Channel()
	require.NoError(t, err)

	var purged []string
	_, err = r.q.Walk(context.Background(), func(m dlq.Message) (dlq.Verdict, error) {
		if len(purged) == 0 {
			held, ok, err := otherCh.Get(r.q.DLQ, false) // B, held unacked
			require.NoError(t, err)
			require.True(t, ok)
			require.Equal(t, "B", held.MessageId)
			r.put("D") // arrives after the walk began
		}
		purged = append(purged, m.D.MessageId)
		return dlq.Remove, nil
	})
	require.NoError(t, err)
	require.Equal(t, []string{"A", "C"}, purged, "the purge acted on a dead letter that arrived after it began")
	require.NoError(t, otherCh.Close()) // the other tool hands B back
	require.ElementsMatch(t, []string{"B", "D"}, r.walk())
}

// TestReadingKeepsTheOrder: a partial look (show -n 2) must not move what it
// read behind the rest.
func TestReadingKeepsTheOrder(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	r.put("A", "B", "C", "D")
	seen := 0
	_, err := r.q.Walk(context.Background(), func(dlq.Message) (dlq.Verdict, error) {
		if seen++; seen == 2 {
			return dlq.Stop, nil
		}
		return dlq.Keep, nil
	})
	require.NoError(t, err)
	require.Equal(t, []string{"A", "B", "C", "D"}, r.walk())
	require.Equal(t, []string{"A", "B", "C", "D"}, r.walk(), "and again")
}

// TestWalksNeverSpendADeliveryBudget: a quorum queue counts every message
// handed back as a failed delivery, and a broker with a delivery limit on
// the dead-letter queue (RabbitMQ 4: 20 by default) drops a message past
// it. No number of walks may spend one.
func TestWalksNeverSpendADeliveryBudget(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	r.put("A")
	for range 5 {
		require.Equal(t, []string{"A"}, r.walk())
	}
	d, ok, err := r.ch.Get(r.q.DLQ, false)
	require.NoError(t, err)
	require.True(t, ok)
	require.Contains(t, []any{nil, int64(0)}, d.Headers["x-delivery-count"], "the walks handed the message back: %v", d.Headers)
	require.False(t, d.Redelivered)
	require.NoError(t, d.Nack(false, true))
}

// putFence publishes the fence of another walk, begun age ago, holding the
// queue owner ("": an older idem's fence, which names none).
func (r *rig) putFence(owner string, age time.Duration) {
	r.t.Helper()
	h := amqp.Table{dlq.HeaderFence: "walk-of-" + r.t.Name()}
	if owner != "" {
		h[dlq.HeaderFence] = strings.TrimPrefix(owner, "idem.dlq-walk.")
		h[dlq.HeaderFenceOwner] = owner
	}
	require.NoError(r.t, r.ch.Confirm(false))
	dc, err := r.ch.PublishWithDeferredConfirmWithContext(context.Background(), "", r.q.DLQ, true, false, amqp.Publishing{
		Headers: h, Timestamp: time.Now().Add(-age), DeliveryMode: amqp.Persistent,
	})
	require.NoError(r.t, err)
	require.True(r.t, dc.Wait())
}

// depth is how many messages the dead-letter queue holds.
func (r *rig) depth() int {
	r.t.Helper()
	q, err := r.ch.QueueDeclarePassive(r.q.DLQ, true, false, false, false, nil)
	require.NoError(r.t, err)
	return q.Messages
}

// TestARunningWalksFenceIsNeverTakenForStale: a walk that has run for more
// than an hour (a slow visitor, a long queue) still holds its queue; another
// walk must keep its fence, or the first would never meet it and walk its own
// re-published messages again and again. A fence whose walk is gone, and an
// older idem's fence past the hour, are removed.
func TestARunningWalksFenceIsNeverTakenForStale(t *testing.T) {
	for _, c := range []struct {
		name  string
		owner string // "running": a queue this test holds; else a queue name as is
		kept  bool
	}{
		{"running for two hours", "running", true},
		{"its walk gone", "idem.dlq-walk.gone-" + testenv.Name(t), false},
		{"an older idem's", "", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			r := newRig(t)
			owner := c.owner
			if owner == "running" {
				conn, err := amqp.Dial(testenv.AMQPURL())
				require.NoError(t, err)
				t.Cleanup(func() { conn.Close() }) // deletes the queue
				ch, err := conn.Channel()
				require.NoError(t, err)
				owner = "idem.dlq-walk.running-" + testenv.Name(t)
				_, err = ch.QueueDeclare(owner, false, false, true, false, nil)
				require.NoError(t, err)
			}
			r.put("A")
			r.putFence(owner, 2*time.Hour)
			r.put("B")
			require.Equal(t, []string{"A", "B"}, r.walk())
			want := 2
			if c.kept {
				want = 3
			}
			require.Equal(t, want, r.depth(), "the other walk's fence kept: %v", c.kept)
			require.Equal(t, []string{"A", "B"}, r.walk(), "and a second walk passes it")
		})
	}
}

// TestAWalkHoldsItsQueueWhileItRuns: the queue a walk's fence names exists
// while the walk runs and is gone once it returns.
func TestAWalkHoldsItsQueueWhileItRuns(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	r.put("A")
	probe := func(owner string) error {
		conn, err := amqp.Dial(testenv.AMQPURL())
		require.NoError(t, err)
		defer conn.Close()
		ch, err := conn.Channel()
		require.NoError(t, err)
		_, err = ch.QueueDeclarePassive(owner, false, false, true, false, nil)
		return err
	}
	var owner string
	_, err := r.q.Walk(context.Background(), func(m dlq.Message) (dlq.Verdict, error) {
		// The walk's own fence is the only other message: read it behind
		// the walk's back, and hand it back.
		d, ok, err := r.ch.Get(r.q.DLQ, false)
		require.NoError(t, err)
		require.True(t, ok)
		owner, _ = d.Headers[dlq.HeaderFenceOwner].(string)
		require.NoError(t, d.Nack(false, true))
		require.NotEmpty(t, owner, "the fence names no queue: %v", d.Headers)
		var ae *amqp.Error
		require.ErrorAs(t, probe(owner), &ae)
		require.Equal(t, amqp.ResourceLocked, ae.Code, "the running walk's queue is exclusive to it")
		return dlq.Keep, nil
	})
	require.NoError(t, err)
	var ae *amqp.Error
	require.ErrorAs(t, probe(owner), &ae)
	require.Equal(t, amqp.NotFound, ae.Code, "the walk's queue outlived it")
}

// TestAForgedFenceIsALetter: a producer's message with fence headers, which
// the broker dead-lettered (it carries x-death), or whose owner is no
// walk's queue, is a dead letter like any other: a walk visits it, so that
// it can neither hide from every tool behind a fence a running walk seems
// to hold nor be removed unseen as a fence left behind.
func TestAForgedFenceIsALetter(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	// A queue that exists, as a running walk's would.
	held := "idem.dlq-walk.forged-" + testenv.Name(t)
	_, err := r.ch.QueueDeclare(held, false, true, false, false, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sandbox.DeleteQueue(testenv.AMQPURL(), held) })
	forge := func(id string, h amqp.Table) {
		require.NoError(t, r.ch.Confirm(false))
		dc, err := r.ch.PublishWithDeferredConfirmWithContext(context.Background(), "", r.q.DLQ, true, false, amqp.Publishing{
			MessageId: id, Headers: h, Timestamp: time.Now().Add(-2 * time.Hour), DeliveryMode: amqp.Persistent,
		})
		require.NoError(t, err)
		require.True(t, dc.Wait())
	}
	r.put("A")
	forge("dead-lettered", amqp.Table{dlq.HeaderFence: strings.TrimPrefix(held, "idem.dlq-walk."), dlq.HeaderFenceOwner: held,
		"x-death": []any{amqp.Table{"reason": "expired", "queue": r.q.Work, "count": int64(1)}}})
	forge("not its owner", amqp.Table{dlq.HeaderFence: "other", dlq.HeaderFenceOwner: r.q.Work})
	r.put("B")
	require.Equal(t, []string{"A", "dead-lettered", "not its owner", "B"}, r.walk())
	require.Equal(t, 4, r.depth(), "every letter kept")
}
