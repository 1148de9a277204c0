package broker_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/testenv"
)

// TestABatchLeavesInAFewWritesAndArrivesWhole: amqp091 flushes after every
// publish; a Publisher's batch leaves in a few writes all the same (the
// socket is corked around it), and every message is confirmed and arrives
// once, in order.
func TestABatchLeavesInAFewWritesAndArrivesWhole(t *testing.T) {
	q := declare(t, nil)
	p := openPublisher(t, testenv.AMQPURL(), broker.PublisherOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const n = 500
	pad := strings.Repeat("x", 200)
	msgs := make([]broker.Message, n)
	for i := range msgs {
		msgs[i] = msg(q, fmt.Sprintf("%d %s", i, pad))
	}
	before := broker.SocketWrites(p.Conn())
	rs := p.Publish(ctx, msgs...)
	writes := broker.SocketWrites(p.Conn()) - before
	for i, r := range rs {
		require.Equal(t, broker.Confirmed, r.Outcome, "message %d: %v", i, r.Err)
	}
	// About 150 KB on the wire, 32 KiB a write: 5, and room for a
	// heartbeat or two. Uncorked, it was one write a message.
	require.LessOrEqual(t, writes, int64(10), "writes for %d messages", n)

	conn, err := amqp.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	ds, err := ch.Consume(q, "", true, false, false, false, nil)
	require.NoError(t, err)
	for i := range n {
		select {
		case d := <-ds:
			require.Equal(t, fmt.Sprintf("%d %s", i, pad), string(d.Body))
		case <-ctx.Done():
			t.Fatalf("%d of %d messages arrived", i, n)
		}
	}
	select {
	case d := <-ds:
		t.Fatalf("a message more than was published: %.20q", d.Body)
	case <-time.After(300 * time.Millisecond):
	}
}
