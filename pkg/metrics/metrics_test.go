package metrics_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sony/gobreaker/v2"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/metrics"
)

func TestMetricsCountWhatTheObserversSee(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	require.NoError(t, err)
	ctx := context.Background()

	evTime := time.Now().Add(-2 * time.Second)
	m.Settled(ctx, consumer.Settlement{Outcome: guard.OutcomeProcessed, EventTime: evTime})
	m.Settled(ctx, consumer.Settlement{Outcome: guard.OutcomeDuplicateRedis, EventTime: evTime})
	m.Settled(ctx, consumer.Settlement{Outcome: guard.OutcomePayloadConflict, Reason: wire.ReasonPayloadConflict})
	m.Settled(ctx, consumer.Settlement{Outcome: guard.OutcomeDeadLettered, Reason: wire.ReasonDecode})
	m.Settled(ctx, consumer.Settlement{Outcome: guard.OutcomeRetry, Reason: wire.RequeueShutdown})

	require.Equal(t, 1.0, deliveries(t, reg, "processed", ""))
	require.Equal(t, 1.0, deliveries(t, reg, "payload_conflict", "payload_conflict"))
	require.Zero(t, deliveries(t, reg, "dead_lettered", ""), "a conflict is counted once, as payload_conflict")
	require.Equal(t, 1.0, value(t, reg, "idem_dead_letters_total", map[string]string{"reason": "payload_conflict"}))
	require.Equal(t, 1.0, value(t, reg, "idem_dead_letters_total", map[string]string{"reason": "decode_error"}))
	age := histogram(t, reg, "idem_event_age_seconds", nil)
	require.Equal(t, uint64(2), age.GetSampleCount(), "only acked deliveries have an age")
	require.InDelta(t, 4.0, age.GetSampleSum(), 0.5)

	m.ObserveStage(ctx, guard.StageFastClaim, 10, 3*time.Millisecond, gobreaker.ErrOpenState)
	m.ObserveStage(ctx, guard.StageMarkDone, 10, time.Millisecond, context.DeadlineExceeded)
	m.ObserveStage(ctx, guard.StageCommit, 10, 5*time.Millisecond, errors.New("conn closed"))
	m.ObserveStage(ctx, guard.StageApply, 10, 7*time.Millisecond, nil)
	require.Equal(t, 1.0, value(t, reg, "idem_redis_errors_total", map[string]string{"op": "fast_claim", "kind": "breaker_open"}))
	require.Equal(t, 1.0, value(t, reg, "idem_redis_errors_total", map[string]string{"op": "mark_done", "kind": "timeout"}))
	require.Equal(t, 1.0, value(t, reg, "idem_postgres_errors_total", map[string]string{"stage": "commit"}))
	apply := histogram(t, reg, "idem_stage_duration_seconds", map[string]string{"stage": "apply"})
	require.Equal(t, uint64(1), apply.GetSampleCount())
	require.InDelta(t, 0.007, apply.GetSampleSum(), 1e-9)

	m.Count(wire.CounterStoreRetry, 3)
	m.Gathered(200)
	require.Equal(t, 3.0, value(t, reg, "idem_store_retries_in_place_total", nil))
	require.Equal(t, 200.0, histogram(t, reg, "idem_batch_size", nil).GetSampleSum())

	require.Equal(t, 1.0, value(t, reg, "idem_breaker_state", map[string]string{"state": "closed"}))
	m.BreakerChanged("closed", "open")
	require.Equal(t, 1.0, value(t, reg, "idem_breaker_state", map[string]string{"state": "open"}))
	require.Equal(t, 0.0, value(t, reg, "idem_breaker_state", map[string]string{"state": "closed"}))
	require.Equal(t, 1.0, value(t, reg, "idem_breaker_open", nil))
	require.Equal(t, 1.0, value(t, reg, "idem_breaker_transitions_total", map[string]string{"from": "closed", "to": "open"}))

	require.NoError(t, m.WatchConsumer(func() consumer.Stats {
		return consumer.Stats{Consuming: true, InFlight: 7, Unacked: 9, Prefetch: 64}
	}))
	require.Equal(t, 7.0, value(t, reg, "idem_deliveries_in_flight", nil))
	require.Equal(t, 9.0, value(t, reg, "idem_prefetch_in_use", nil))
	require.Equal(t, 64.0, value(t, reg, "idem_prefetch_limit", nil))
	require.Equal(t, 1.0, value(t, reg, "idem_consuming", nil))

	_, err = metrics.New(reg)
	require.Error(t, err, "a second set on one registry is refused, not silently merged")
}

func deliveries(t *testing.T, reg *prometheus.Registry, outcome, reason string) float64 {
	t.Helper()
	return value(t, reg, "idem_deliveries_total", map[string]string{"outcome": outcome, "reason": reason})
}
