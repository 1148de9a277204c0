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
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
)

func openPublisher(t *testing.T, url string, opts broker.PublisherOptions) *broker.Publisher {
	t.Helper()
	conn, _, err := broker.Dial([]string{url}, 0, amqp.Config{})
	require.NoError(t, err)
	p, err := broker.NewPublisher(conn, opts)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// declare makes a queue of the test's own with args.
func declare(t *testing.T, args amqp.Table) string {
	t.Helper()
	q := testenv.Queue(t, testenv.AMQPURL())
	conn, err := amqp.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	_, err = ch.QueueDeclare(q, true, false, false, false, args)
	require.NoError(t, err)
	return q
}

func msg(queue, body string) broker.Message {
	return broker.Message{Key: queue, Publishing: amqp.Publishing{Body: []byte(body), DeliveryMode: amqp.Persistent}}
}

func outcomes(rs []broker.Result) []broker.Outcome {
	out := make([]broker.Outcome, len(rs))
	for i, r := range rs {
		out[i] = r.Outcome
	}
	return out
}

// TestPublisherSaysHowTheBrokerAnsweredEachMessage: confirmed, returned,
// nacked and invalid are told apart within one Publish, and an invalid
// message neither goes out nor costs its neighbours their connection.
func TestPublisherSaysHowTheBrokerAnsweredEachMessage(t *testing.T) {
	q := declare(t, nil)
	full := declare(t, amqp.Table{"x-max-length": int32(1), "x-overflow": "reject-publish"})
	p := openPublisher(t, testenv.AMQPURL(), broker.PublisherOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	long := msg(q, "x")
	long.Type = strings.Repeat("t", 256)
	rs := p.Publish(ctx, msg(q, "a"), msg("idem.test.nobody-binds-this", "b"), msg(full, "c"), msg(full, "d"), long, msg(q, "e"))
	require.Equal(t, []broker.Outcome{broker.Confirmed, broker.Returned, broker.Confirmed, broker.Nacked, broker.Invalid, broker.Confirmed}, outcomes(rs),
		"%v", rs)
	require.ErrorContains(t, rs[4].Err, "AMQP allows 255")
	require.Equal(t, 3, testenv.QueueDepth(t, testenv.AMQPURL(), q)+testenv.QueueDepth(t, testenv.AMQPURL(), full), "a, c and e")
	require.NoError(t, p.Err(), "nothing ended the publisher")
}

// TestPublisherRefusedByAChannelException: a publish to an exchange that
// does not exist makes the broker close the channel; the message is
// Refused (the broker's answer), and the publisher ends.
func TestPublisherRefusedByAChannelException(t *testing.T) {
	p := openPublisher(t, testenv.AMQPURL(), broker.PublisherOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rs := p.Publish(ctx, broker.Message{Exchange: "idem.test.no-such-exchange-" + testenv.Name(t), Key: "k"})
	require.Equal(t, broker.Refused, rs[0].Outcome, "%v", rs[0].Err)
	require.ErrorContains(t, rs[0].Err, "404")
	waitDone(t, p)
	rs = p.Publish(ctx, msg("q", "after"))
	require.Equal(t, broker.Unanswered, rs[0].Outcome, "an ended publisher sends nothing")
}

// TestPublisherEndsOnEveryConnectionLoss cuts the connection at each point
// of a publish: Publish returns every message Unanswered (never Nacked or
// Refused: a lost connection says nothing about a message), Done closes,
// and Close returns at once (the notification channels were read to their
// end: nothing spins on them).
func TestPublisherEndsOnEveryConnectionLoss(t *testing.T) {
	q := declare(t, nil)
	for _, tc := range []struct {
		name string
		cut  sandbox.Cut
		msgs []broker.Message
	}{
		{"at the first basic.publish", sandbox.Cut{Dir: sandbox.ToServer, Method: sandbox.BasicPublish}, []broker.Message{msg(q, "a"), msg(q, "b")}},
		{"at the third basic.publish", sandbox.Cut{Dir: sandbox.ToServer, Method: sandbox.BasicPublish, After: 2}, []broker.Message{msg(q, "a"), msg(q, "b"), msg(q, "c"), msg(q, "d")}},
		{"before the ack of a returned message", sandbox.Cut{Dir: sandbox.ToClient, Method: sandbox.BasicAck}, []broker.Message{msg("idem.test.nobody-binds-this", "r")}},
		{"stalled before the ack", sandbox.Cut{Dir: sandbox.ToClient, Method: sandbox.BasicAck, Stall: true}, []broker.Message{msg(q, "s")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			proxy, url := testenv.AMQPCut(t)
			p := openPublisher(t, url, broker.PublisherOptions{})
			proxy.Arm(tc.cut)
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			rs := p.Publish(ctx, tc.msgs...)
			require.Equal(t, 1, proxy.Fired())
			for i, r := range rs {
				if r.Outcome == broker.Confirmed {
					continue // published before the cut
				}
				require.Equal(t, broker.Unanswered, r.Outcome, "message %d: %v", i, r.Err)
			}
			if !tc.cut.Stall {
				waitDone(t, p)
			}
			closed := make(chan error, 1)
			go func() { closed <- p.Close() }()
			select {
			case <-closed:
			case <-time.After(5 * time.Second):
				t.Fatal("Close did not return: the publisher's watcher is stuck")
			}
		})
	}
}

func waitDone(t *testing.T, p *broker.Publisher) {
	t.Helper()
	select {
	case <-p.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the publisher did not see its channel end")
	}
	require.Error(t, p.Err())
}

// TestEveryReturnInABatchIsToldApart: batches mixing routable and
// unroutable messages, the returns interleaved with acks (some multiple):
// Publish waits once a batch for the returns to be read, and still tells
// every returned message from the confirmed ones.
func TestEveryReturnInABatchIsToldApart(t *testing.T) {
	q := declare(t, nil)
	p := openPublisher(t, testenv.AMQPURL(), broker.PublisherOptions{})
	for round := range 20 {
		var msgs []broker.Message
		var want []broker.Outcome
		for i := range 300 {
			if (i*7+round)%5 == 0 {
				msgs = append(msgs, msg("idem.test.nobody-binds-this", fmt.Sprint(i)))
				want = append(want, broker.Returned)
			} else {
				msgs = append(msgs, msg(q, fmt.Sprint(i)))
				want = append(want, broker.Confirmed)
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		rs := p.Publish(ctx, msgs...)
		cancel()
		require.Equal(t, want, outcomes(rs), "round %d", round)
	}
}
