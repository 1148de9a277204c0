package metrics_test

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/metrics"
)

// TestTheKillSwitchGaugeNamesItsClass: idem_kill_switch_open is one series,
// 0 with class="" while the switch is closed and 1 with the class it
// tripped on while open, so that the alert can name it; each trip counts.
func TestTheKillSwitchGaugeNamesItsClass(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	require.NoError(t, err)
	var s consumer.Stats
	require.NoError(t, m.WatchConsumer(func() consumer.Stats { return s }))
	require.Equal(t, 0.0, value(t, reg, "idem_kill_switch_open", map[string]string{"class": ""}))
	require.Equal(t, 0.0, value(t, reg, "idem_kill_switch_trips_total", nil))

	s.Tripped, s.TrippedOn = "kill switch open for 3s: 5 distinct events failed with 42P01 …", "42P01"
	m.Count(wire.CounterKillSwitchTrips, 1)
	require.Equal(t, 1.0, value(t, reg, "idem_kill_switch_open", map[string]string{"class": "42P01"}))
	require.Equal(t, 1.0, value(t, reg, "idem_kill_switch_trips_total", nil))
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() == "idem_kill_switch_open" {
			require.Len(t, f.GetMetric(), 1, "one series at a time")
		}
	}
}
