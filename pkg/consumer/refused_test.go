package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
)

// handshakeCuts closes the next n connections right after the client's
// connection.start-ok, as a broker restarting or a dropped link does:
// amqp091 reports each as bad credentials.
func handshakeCuts(n int) []sandbox.Cut {
	cuts := make([]sandbox.Cut, n)
	for i := range cuts {
		cuts[i] = sandbox.Cut{Dir: sandbox.ToServer, Method: sandbox.ConnectionStartOk}
	}
	return cuts
}

// requireLedger requires ledger to hold each of n events once.
func (r *rig) requireLedger(n int) {
	r.t.Helper()
	r.requireLedgerWithin(n, 30*time.Second)
}

// requireLedgerWithin is requireLedger waiting up to d.
func (r *rig) requireLedgerWithin(n int, d time.Duration) {
	r.t.Helper()
	var rows, distinct int
	require.Eventually(r.t, func() bool {
		require.NoError(r.t, r.pool.QueryRow(context.Background(), `SELECT count(*), count(DISTINCT event_id) FROM ledger`).Scan(&rows, &distinct))
		return distinct == n
	}, d, 20*time.Millisecond, "ledger: %d distinct events", distinct)
	require.Equal(r.t, n, rows, "an event applied twice")
}

// TestADroppedHandshakeNeverEndsARunningConsumer: once consuming, the
// consumer's connection is cut and every handshake after it is dropped
// right after start-ok, for longer than a refusal is given at start. The
// consumer keeps retrying, is not consuming and says why, counts each
// refusal, and consumes again once the link heals, losing and doubling
// nothing. Before, its first reconnect returned ErrBrokerRefused ("username
// or password not allowed") and the process exited.
func TestADroppedHandshakeNeverEndsARunningConsumer(t *testing.T) {
	t.Parallel()
	proxy, _ := testenv.AMQPCut(t)
	r := startRig(t, batchHandler{}, func(cfg *consumer.Config) {
		cfg.URL = proxy.URL(cfg.URL)
		cfg.ReconnectBackoff = consumer.Backoff{Min: 10 * time.Millisecond, Max: 200 * time.Millisecond}
	})
	for i := range 5 {
		r.publish(fmt.Sprintf("evt_%d", i), fmt.Sprintf("body_%d", i))
	}
	r.requireLedger(5)

	// The link drops; every handshake after it is dropped too, until the
	// proxy is disarmed.
	proxy.Arm(handshakeCuts(10000)...)
	proxy.Drop()
	r.publish("evt_5", "body_5")
	require.Eventually(t, func() bool {
		return r.stats[wire.CounterBrokerRefused].Load() >= broker.RefusedTries
	}, 30*time.Second, 10*time.Millisecond, "no refusal counted")
	first := time.Now()
	s := r.consumerStats()
	require.False(t, s.Consuming)
	require.Contains(t, s.Refused, "dropped it during the handshake")
	require.Contains(t, s.Refused, "username or password not allowed")
	// Past what a refusal gets at start, the consumer still retries.
	require.Eventually(t, func() bool { return time.Since(first) > broker.RefusedFor+time.Second }, 10*time.Second, 50*time.Millisecond)
	select {
	case <-r.ended:
		t.Fatal("Run returned on a dropped handshake")
	default:
	}
	refusals := r.stats[wire.CounterBrokerRefused].Load()
	require.Greater(t, refusals, int64(broker.RefusedTries))

	proxy.Disarm()
	require.Eventually(t, func() bool { return r.consumerStats().Consuming }, 30*time.Second, 10*time.Millisecond)
	require.Empty(t, r.consumerStats().Refused)
	for i := 6; i < 10; i++ {
		r.publish(fmt.Sprintf("evt_%d", i), fmt.Sprintf("body_%d", i))
	}
	r.requireLedger(10)
}

// TestABlipAtStartIsNotABadPassword: the first handshakes of a consumer
// that has not consumed yet are dropped, fewer times than a refusal must
// last at start. It consumes once the link heals; before, the first drop
// ended Run with ErrBrokerRefused.
func TestABlipAtStartIsNotABadPassword(t *testing.T) {
	t.Parallel()
	proxy, _ := testenv.AMQPCut(t)
	proxy.Arm(handshakeCuts(5)...)
	r := startRig(t, batchHandler{}, func(cfg *consumer.Config) {
		cfg.URL = proxy.URL(cfg.URL)
		cfg.ReconnectBackoff = consumer.Backoff{Min: 10 * time.Millisecond, Max: 100 * time.Millisecond}
	})
	r.publish("evt_1", "body_1")
	r.requireLedger(1)
	require.Equal(t, 5, proxy.Fired())
	require.Equal(t, int64(5), r.stats[wire.CounterBrokerRefused].Load())
}

// refusals counts the consumer's refusals; it ignores the rest.
type refusals struct{ n atomic.Int64 }

func (r *refusals) Settled(context.Context, consumer.Settlement) {}
func (r *refusals) Gathered(int)                                 {}
func (r *refusals) Count(name string, n int) {
	if name == wire.CounterBrokerRefused {
		r.n.Add(int64(n))
	}
}

// TestAWrongPasswordAtStartIsRefused: a password the broker refuses ends
// Run with ErrBrokerRefused, naming what to check, once the refusal has
// repeated over a few seconds, not at the first. (RabbitMQ answers a bad
// login by closing the socket three seconds later, without a word: amqp091
// cannot tell it from a dropped handshake.)
func TestAWrongPasswordAtStartIsRefused(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t)
	g, err := guard.New(guard.Config{Scope: "svc", Store: pgtier.New(pool)})
	require.NoError(t, err)
	url := strings.Replace(testenv.AMQPURL(), "guest:guest", "guest:wrong", 1)
	seen := &refusals{}
	c, err := consumer.New(consumer.Config{URL: url, Queue: testenv.Queue(t, testenv.AMQPURL()),
		ReconnectBackoff: consumer.Backoff{Min: 50 * time.Millisecond, Max: 500 * time.Millisecond},
		Observer:         seen, Logger: slog.New(slog.DiscardHandler)}, g, batchHandler{})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	began := time.Now()
	err = c.Run(ctx)
	require.True(t, errors.Is(err, consumer.ErrBrokerRefused), "%v", err)
	require.ErrorContains(t, err, "check the URL's user, password and vhost")
	require.ErrorContains(t, err, "403")
	require.GreaterOrEqual(t, seen.n.Load(), int64(broker.RefusedTries-1), "refused at the first try")
	require.GreaterOrEqual(t, time.Since(began), broker.RefusedFor)
}
