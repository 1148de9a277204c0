package dlq_test

import (
	"context"
	"testing"

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
	q, err := dlq.Open(url, topo)
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
