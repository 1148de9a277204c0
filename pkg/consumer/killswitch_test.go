package consumer_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
)

// TestAMissingTableTripsTheKillSwitchAndDeadLettersNothing: the handler's
// table is dropped (a migration forgotten in a deploy), so every event fails
// with 42P01 from a real Postgres. The consumer must not dead-letter the
// stream: it trips, says so in Stats (so /readyz), hands back what it holds
// without spending the events' attempts (the event it probes with is
// handed back again and again, past DeliveryLimit, and never
// dead-lettered), and once the table is created it resumes by itself and
// applies every event exactly once. Before the kill switch, each event was
// dead-lettered after DeliveryLimit attempts.
func TestAMissingTableTripsTheKillSwitchAndDeadLettersNothing(t *testing.T) {
	t.Parallel()
	const events, deliveryLimit = 40, 3
	r := startRig(t, batchHandler{}, func(cfg *consumer.Config) {
		cfg.Prefetch, cfg.BatchSize, cfg.BatchLinger = 16, 8, 20*time.Millisecond
		cfg.DeliveryLimit = deliveryLimit
		cfg.KillSwitch = consumer.KillSwitch{Probe: consumer.Backoff{Min: 100 * time.Millisecond, Max: 400 * time.Millisecond}}
	})
	ctx := context.Background()
	_, err := r.pool.Exec(ctx, `DROP TABLE ledger`)
	require.NoError(t, err)
	for i := range events {
		r.publish(fmt.Sprintf("evt_%d", i), fmt.Sprintf("body_%d", i))
	}

	// Tripped: not consuming between probes, and saying why.
	var s consumer.Stats
	require.Eventually(t, func() bool { s = r.consumerStats(); return s.Tripped != "" && !s.Consuming },
		30*time.Second, time.Millisecond, "the kill switch never tripped")
	require.Equal(t, "42P01", s.TrippedOn)
	require.Contains(t, s.Tripped, `relation "ledger" does not exist`)
	require.Equal(t, int64(1), r.stats[wire.CounterKillSwitchTrips].Load())
	// Several probes fail the same way; each hands its delivery back.
	handedBack := func() int {
		n := 0
		for _, st := range r.settlements() {
			if st.Outcome == guard.OutcomeRetry && st.Reason == wire.RequeueKillSwitch {
				n++
			}
		}
		return n
	}
	afterTrip := handedBack()
	// The probes hand their event back unspent: wait until one was handed
	// back on a delivery past DeliveryLimit (a spent attempt would have
	// dead-lettered it there).
	pastLimit := func() string {
		for _, st := range r.settlements() {
			if st.Outcome == guard.OutcomeRetry && st.Reason == wire.RequeueKillSwitch && st.Attempt > deliveryLimit {
				return st.EventID
			}
		}
		return ""
	}
	require.Eventually(t, func() bool { return handedBack() >= afterTrip+4 && pastLimit() != "" }, 30*time.Second, 10*time.Millisecond,
		"the probes did not fail and hand back past DeliveryLimit")
	probed := pastLimit()
	require.Equal(t, int64(1), r.stats[wire.CounterKillSwitchTrips].Load(), "a failed probe is not a new trip")
	require.NotEmpty(t, r.consumerStats().Tripped)
	require.Zero(t, r.stats[guard.OutcomeDeadLettered.String()].Load(), "dead-lettered while the deploy was broken")

	// The fix lands: the next probe is processed and the consumer resumes.
	_, err = r.pool.Exec(ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, event_id text NOT NULL, user_id text NOT NULL, amount bigint NOT NULL)`)
	require.NoError(t, err)
	r.requireLedger(events)
	require.Eventually(t, func() bool { s = r.consumerStats(); return s.Tripped == "" && s.Consuming }, 30*time.Second, 10*time.Millisecond)
	require.Empty(t, s.TrippedOn)
	require.Zero(t, r.stats[guard.OutcomeDeadLettered.String()].Load())
	require.Zero(t, testenv.QueueDepth(t, testenv.AMQPURL(), r.queue+".dlq"), "dead letters")
	require.Eventually(t, func() bool { return testenv.QueueDepth(t, testenv.AMQPURL(), r.queue) == 0 }, 10*time.Second, 10*time.Millisecond)
	// The attempts the hand-backs cost were never spent: the event handed
	// back past DeliveryLimit deliveries was processed, not dead-lettered.
	processed := 0
	for _, st := range r.settlements() {
		if st.EventID == probed && st.Outcome == guard.OutcomeProcessed {
			processed++
			require.Greater(t, st.Attempt, deliveryLimit)
		}
	}
	require.Equal(t, 1, processed, "the event handed back past DeliveryLimit was not processed once")
}

// TestPoisonAmongGoodEventsIsDeadLetteredWithoutATrip: more bad events than
// the threshold, all failing the same way, but few among good ones: each is
// dead-lettered after DeliveryLimit attempts as ever, and the switch stays
// closed.
func TestPoisonAmongGoodEventsIsDeadLetteredWithoutATrip(t *testing.T) {
	t.Parallel()
	const good, poison = 80, 6
	r := startRig(t, batchHandler{}, func(cfg *consumer.Config) {
		cfg.Prefetch, cfg.BatchSize, cfg.BatchLinger = 16, 8, 20*time.Millisecond
		cfg.KillSwitch = consumer.KillSwitch{Threshold: poison - 1}
	})
	for i := range good {
		if i%(good/poison) == good/poison/2 && i/(good/poison) < poison {
			r.publish(fmt.Sprintf("evt_poison_%d", i), "poison")
		}
		r.publish(fmt.Sprintf("evt_%d", i), fmt.Sprintf("body_%d", i))
	}
	for range poison {
		d := r.deadLetter()
		require.Contains(t, d.MessageId, "evt_poison_")
		require.Equal(t, wire.ReasonHandlerFailed, d.Headers[wire.HeaderReason])
	}
	r.requireLedger(good)
	require.Zero(t, r.stats[wire.CounterKillSwitchTrips].Load(), "poison among good events tripped the switch")
	s := r.consumerStats()
	require.Empty(t, s.Tripped)
	require.True(t, s.Consuming)
}
