package dlq_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/dlq"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/wire"
)

// putBig has the broker dead-letter into the rig's queue messages with
// these IDs whose headers filled their frame all but a hundred bytes: the
// broker took each, and x-death takes each above frame_max.
func (r *rig) putBig(ids ...string) {
	r.t.Helper()
	url := testenv.AMQPURL()
	side := r.q.Topology.Queue + ".side"
	r.t.Cleanup(func() { _, _ = r.ch.QueueDelete(side, false, false, false) })
	_, err := r.ch.QueueDeclare(side, true, false, false, false, amqp.Table{
		"x-dead-letter-exchange": r.q.Topology.DeadLetterExchange, "x-dead-letter-routing-key": r.q.DLQ,
	})
	require.NoError(r.t, err)
	conn, err := amqp.Dial(url)
	require.NoError(r.t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(r.t, err)
	require.NoError(r.t, ch.Confirm(false))
	before := r.depth()
	for _, id := range ids {
		dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), "", side, true, false, amqp.Publishing{
			MessageId: id, Body: []byte("body of " + id), DeliveryMode: amqp.Persistent,
			Headers: amqp.Table{"big": strings.Repeat("h", conn.Config.FrameSize-100), "small": "s"},
		})
		require.NoError(r.t, err)
		require.True(r.t, dc.Wait())
		d, ok, err := ch.Get(side, false)
		require.NoError(r.t, err)
		require.True(r.t, ok)
		require.NoError(r.t, d.Nack(false, false)) // dead-lettered by the broker, with x-death
	}
	require.Eventually(r.t, func() bool { return r.depth() == before+len(ids) }, 10*time.Second, 10*time.Millisecond)
}

// TestTheToolsHandleALetterAboveTheFrameMax: a letter the broker
// dead-lettered can come in above the frame_max a client negotiates, and
// go back out only within it. Before, every walk failed on it (amqp091
// refused the frame), left its fence behind, and no tool could reach it or
// anything behind it. Now a replay leaves out the producer's largest
// header and says so, a look keeps the letter (cut the same way, the
// broker's x-death kept), and a purge removes it; depth moves only by
// what the tools removed.
func TestTheToolsHandleALetterAboveTheFrameMax(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	r.putBig("big-1", "big-2")
	r.put("after")
	ctx := context.Background()

	rp, err := r.q.Replayer()
	require.NoError(t, err)
	_, err = r.q.Walk(ctx, func(m dlq.Message) (dlq.Verdict, error) {
		if m.D.MessageId != "big-1" {
			return dlq.Keep, nil
		}
		require.True(t, m.ByBroker)
		return dlq.Remove, rp.Replay(ctx, m)
	})
	require.NoError(t, err)
	require.Equal(t, 2, r.depth())
	replay, ok, err := r.ch.Get(r.q.Work, true)
	require.NoError(t, err)
	require.True(t, ok, "the replay is on the work queue")
	require.Equal(t, "big-1", replay.MessageId)
	require.Equal(t, "big", replay.Headers[wire.HeaderHeadersDropped])
	require.Equal(t, "s", replay.Headers["small"])
	require.Equal(t, int64(1), replay.Headers[wire.HeaderReplays])
	require.NotContains(t, replay.Headers, "x-death")

	var seen []dlq.Message
	_, err = r.q.Walk(ctx, func(m dlq.Message) (dlq.Verdict, error) {
		seen = append(seen, m)
		return dlq.Keep, nil
	})
	require.NoError(t, err)
	require.Len(t, seen, 2)
	require.Equal(t, "big-2", seen[0].D.MessageId)
	require.True(t, seen[0].ByBroker, "the broker's x-death is kept")
	require.Equal(t, "rejected", seen[0].Reason)
	require.Equal(t, "big", seen[0].HeadersDropped)
	require.Equal(t, "s", seen[0].D.Headers["small"])
	require.Equal(t, "after", seen[1].D.MessageId)
	require.Empty(t, seen[1].HeadersDropped)
	require.Equal(t, 2, r.depth(), "no fence left behind")

	_, err = r.q.Walk(ctx, func(dlq.Message) (dlq.Verdict, error) { return dlq.Remove, nil })
	require.NoError(t, err)
	require.Zero(t, r.depth())
}

// TestAFailedWalkLeavesNoFence: a visitor that fails (a replay the broker
// refused, say) ends the walk with its error, but the walk still moves the
// rest of its snapshot on and removes its fence: before, each failed walk
// left its fence behind, and the rest of the snapshot ahead of it.
func TestAFailedWalkLeavesNoFence(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	r.put("A", "B", "C")
	failure := errors.New("the visitor failed")
	var visited []string
	_, err := r.q.Walk(context.Background(), func(m dlq.Message) (dlq.Verdict, error) {
		visited = append(visited, m.D.MessageId)
		if m.D.MessageId == "B" {
			return dlq.Remove, failure
		}
		return dlq.Keep, nil
	})
	require.ErrorIs(t, err, failure)
	require.Equal(t, []string{"A", "B"}, visited, "no visit after the failure")
	require.Equal(t, 3, r.depth(), "the fence is gone, and the letter that failed is kept")
	require.Equal(t, []string{"A", "B", "C"}, r.walk())
}
