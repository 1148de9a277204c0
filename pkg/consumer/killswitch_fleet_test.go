package consumer_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
)

// dlqSince collects the dead letters that reach the rig's DLQ within d.
func (r *rig) dlqFor(d time.Duration) []amqp.Delivery {
	r.t.Helper()
	var out []amqp.Delivery
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		m, ok, err := r.ch.Get(r.queue+".dlq", true)
		require.NoError(r.t, err)
		if ok {
			out = append(out, m)
			continue
		}
		time.Sleep(20 * time.Millisecond)
	}
	return out
}

func describeLetters(ls []amqp.Delivery) string {
	var b strings.Builder
	for _, l := range ls {
		reason, _ := l.Headers[wire.HeaderReason].(string)
		if reason == "" {
			reason = "<no x-idem-reason>"
		}
		_, death := l.Headers["x-death"]
		fmt.Fprintf(&b, "\n  %s reason=%s x-death=%v idem-delivery-count=%v", l.MessageId, reason, death, l.Headers[wire.HeaderDeliveryCount])
	}
	return b.String()
}

// TestAProbeOnAnEmptyQueueResumes: two consumers of a fleet trip on a
// missing table. The table is created; B (restarted, or simply first to
// probe) drains the queue. A's probe then finds the queue empty: it
// resumes (armed) after Probe.Min and a handler timeout instead of staying
// tripped, not ready and paging, until new traffic arrives.
func TestAProbeOnAnEmptyQueueResumes(t *testing.T) {
	t.Parallel()
	r := startRig(t, batchHandler{}, func(cfg *consumer.Config) {
		cfg.Prefetch, cfg.BatchSize, cfg.BatchLinger = 16, 8, 20*time.Millisecond
		cfg.DeliveryLimit, cfg.HandlerTimeout = 3, time.Second
		cfg.KillSwitch = consumer.KillSwitch{Probe: consumer.Backoff{Min: 2 * time.Second, Max: 2 * time.Second}}
	})
	ctx := context.Background()
	_, err := r.pool.Exec(ctx, `DROP TABLE ledger`)
	require.NoError(t, err)
	const events = 12
	for i := range events {
		r.publish(fmt.Sprintf("evt_%d", i), fmt.Sprintf("body_%d", i))
	}
	require.Eventually(t, func() bool { return r.consumerStats().Tripped != "" }, 30*time.Second, time.Millisecond, "never tripped")

	// The fix lands, and consumer B (another member of the fleet) drains
	// the queue before A's probe.
	_, err = r.pool.Exec(ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, event_id text NOT NULL, user_id text NOT NULL, amount bigint NOT NULL)`)
	require.NoError(t, err)
	g, err := guard.New(guard.Config{Scope: "svc", Store: pgtier.New(r.pool)})
	require.NoError(t, err)
	b, err := consumer.New(consumer.Config{URL: testenv.AMQPURL(), Queue: r.queue, Workers: 2, Prefetch: 16, DeliveryLimit: 3,
		RetryBackoff: consumer.Backoff{Min: 10 * time.Millisecond, Max: 50 * time.Millisecond},
		Logger:       slog.New(slog.DiscardHandler)}, g, batchHandler{})
	require.NoError(t, err)
	bctx, stopB := context.WithCancel(ctx)
	bDone := make(chan error, 1)
	go func() { bDone <- b.Run(bctx) }()
	t.Cleanup(func() { stopB(); <-bDone })
	r.requireLedger(events)

	// A's probe meets no delivery: within Probe.Min and a handler timeout
	// (3s) of its start, it resumes.
	require.Eventually(t, func() bool { return r.consumerStats().Tripped == "" }, 10*time.Second, 20*time.Millisecond,
		"the deploy was fixed and every event processed, yet A still says: %s", r.consumerStats().Tripped)
}

// partlyBroken fails the events whose body starts with "bad" on a table a
// deploy forgot (42P01 from a real Postgres), and records the others.
type partlyBroken struct{ handlerFunc }

func (partlyBroken) Apply(ctx context.Context, tx pgx.Tx, v []byte) error {
	if strings.HasPrefix(string(v), "bad") {
		_, err := tx.Exec(ctx, `INSERT INTO refunds_forgotten (event_id) VALUES ($1)`, string(v))
		return err
	}
	_, err := tx.Exec(ctx, `INSERT INTO ledger (event_id, user_id, amount) VALUES ($1, 'u', 1)`, string(v))
	return err
}

// TestAPartlyBrokenDeployDeadLettersNoneOfItsBrokenEvents: a deploy forgot
// the table of one event type, three fifths of the traffic: they all fail
// with 42P01, far past the rate, and the switch trips. A probe that takes
// one of the good events closes it; the broken events come back with every
// hand-back counted in x-delivery-count (the attempt counter). Armed after
// the resume, the switch trips again at the first failure of 42P01, so none
// of them is dead-lettered by the consumer while the deploy is broken.
func TestAPartlyBrokenDeployDeadLettersNoneOfItsBrokenEvents(t *testing.T) {
	t.Parallel()
	r := startRig(t, partlyBroken{}, func(cfg *consumer.Config) {
		cfg.Prefetch, cfg.BatchSize, cfg.BatchLinger = 16, 8, 20*time.Millisecond
		cfg.DeliveryLimit = 3
		cfg.KillSwitch = consumer.KillSwitch{Probe: consumer.Backoff{Min: 20 * time.Millisecond, Max: 100 * time.Millisecond}}
	})
	for i := range 100 {
		body := fmt.Sprintf("bad_%d", i)
		if i%5 >= 3 {
			body = fmt.Sprintf("good_%d", i)
		}
		r.publish(fmt.Sprintf("evt_%d", i), body)
	}
	letters := r.dlqFor(10 * time.Second)
	trips := r.stats[wire.CounterKillSwitchTrips].Load()
	require.Positive(t, trips, "never tripped")
	var byConsumer []amqp.Delivery
	for _, l := range letters {
		if l.Headers[wire.HeaderReason] != nil {
			byConsumer = append(byConsumer, l)
		}
	}
	// Each of them after the first trip: settled dead-lettered after the
	// first hand-back for the kill switch.
	var firstTrip time.Time
	afterTrip := 0
	for _, st := range r.settlements() {
		if firstTrip.IsZero() && st.Outcome == guard.OutcomeRetry && st.Reason == wire.RequeueKillSwitch {
			firstTrip = st.at
		}
		if !firstTrip.IsZero() && st.Outcome == guard.OutcomeDeadLettered {
			afterTrip++
		}
	}
	t.Logf("dead-lettered by the consumer after the first trip: %d of %d", afterTrip, len(byConsumer))
	require.Zero(t, len(byConsumer), "%d trips; the consumer dead-lettered %d events of the class it tripped on (and the broker %d more):%s",
		trips, len(byConsumer), len(letters)-len(byConsumer), describeLetters(letters))
}

// TestFewEventsInFlightTrip: a consumer that holds few distinct events at
// a time (Prefetch 1, as for strict order; or KeyOrder, whose retries run
// in place, one event after another per worker) only meets a new event once
// an old one is dead-lettered, and the suspect ones are retried up to
// BrokerDeliveryLimit, longer than the window. A class's streak lasts as
// long as its failures keep coming, so the fifth distinct event trips the
// switch, after four dead letters at most. Scaled: Window 2s and
// RetryBackoff 100-400ms stand for the defaults 1m and 200ms-10s;
// Threshold, Rate, DeliveryLimit and BrokerDeliveryLimit are the defaults.
func TestFewEventsInFlightTrip(t *testing.T) {
	t.Parallel()
	for name, tune := range map[string]func(*consumer.Config){
		"prefetch 1": func(cfg *consumer.Config) { cfg.Prefetch, cfg.Workers = 1, 1 },
		"key order":  func(cfg *consumer.Config) { cfg.Prefetch, cfg.Workers, cfg.BatchSize, cfg.KeyOrder = 64, 1, 16, true },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var letters atomic.Int64
			r := startRig(t, batchHandler{}, func(cfg *consumer.Config) {
				tune(cfg)
				cfg.DeliveryLimit = 0 // the default, 5
				cfg.RetryBackoff = consumer.Backoff{Min: 100 * time.Millisecond, Max: 400 * time.Millisecond}
				cfg.KillSwitch = consumer.KillSwitch{Window: 2 * time.Second}
			})
			_, err := r.pool.Exec(context.Background(), `DROP TABLE ledger`)
			require.NoError(t, err)
			for i := range 40 {
				r.publish(fmt.Sprintf("evt_%d", i), fmt.Sprintf("body_%d", i))
			}
			deadline := time.Now().Add(20 * time.Second)
			for time.Now().Before(deadline) && r.stats[wire.CounterKillSwitchTrips].Load() == 0 {
				letters.Store(r.stats[guard.OutcomeDeadLettered.String()].Load())
				time.Sleep(50 * time.Millisecond)
			}
			require.Positive(t, r.stats[wire.CounterKillSwitchTrips].Load(),
				"every event fails with 42P01 and the switch never tripped in 20s; %d events dead-lettered meanwhile", letters.Load())
			require.LessOrEqual(t, letters.Load(), int64(4), "dead-lettered before the trip")
		})
	}
}
