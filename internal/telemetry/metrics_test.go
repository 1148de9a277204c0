package telemetry

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/pkg/guard"
)

func TestCountsAndPrometheusText(t *testing.T) {
	m := New()
	m.Outcome(guard.OutcomeProcessed, "")
	m.Outcome(guard.OutcomeDeadLettered, "invalid_json")
	m.Outcome(guard.OutcomeDeadLettered, "invalid_json")
	m.Outcome(guard.OutcomeDeadLettered, "payload_conflict")
	m.BreakerChange("closed", "open")

	snap := m.Snapshot()
	require.Equal(t, int64(1), snap["processed"])
	require.Equal(t, int64(3), snap["dead_lettered"])
	require.Equal(t, int64(2), snap["dead_lettered/invalid_json"])
	require.Equal(t, int64(0), snap["duplicate_redis"], "every outcome has a zero")
	require.Equal(t, int64(1), snap["breaker/closed->open"])

	var b strings.Builder
	m.WriteProm(&b)
	require.Contains(t, b.String(), `idem_deliveries_total{outcome="dead_lettered",reason="invalid_json"} 2`)
	require.Contains(t, b.String(), `idem_breaker_transitions_total{from="closed",to="open"} 1`)
	require.Contains(t, b.String(), "idem_breaker_open 1")
}

func TestCountersAreSnapshottedAndExposed(t *testing.T) {
	m := New()
	m.Count("store_retries_in_place")
	m.Count("store_retries_in_place")
	m.Count("untimed_accepted")
	snap := m.Snapshot()
	require.Equal(t, int64(2), snap["count/store_retries_in_place"])
	require.Equal(t, int64(1), snap["count/untimed_accepted"])
	var b strings.Builder
	m.WriteProm(&b)
	require.Contains(t, b.String(), "# TYPE idem_store_retries_in_place_total counter\nidem_store_retries_in_place_total 2\n")
	require.Contains(t, b.String(), "idem_untimed_accepted_total 1\n")
}
