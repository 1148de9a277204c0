package consumer

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/wire"
)

func TestCheckTimeEnforcesTheHorizon(t *testing.T) {
	now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	day := 24 * time.Hour
	cases := []struct {
		name    string
		cfg     Config
		t       time.Time
		reason  string
		counted bool
	}{
		{"fresh", Config{Retention: 30 * day}, now.Add(-time.Hour), "", false},
		{"just inside", Config{Retention: 30 * day}, now.Add(-30*day + time.Second), "", false},
		{"at the horizon", Config{Retention: 30 * day}, now.Add(-30 * day), wire.ReasonBeyondRetention, false},
		{"a year old", Config{Retention: 30 * day}, now.Add(-365 * day), wire.ReasonBeyondRetention, false},
		{"a year ahead", Config{Retention: 30 * day}, now.Add(365 * day), wire.ReasonFutureTimestamp, false},
		{"ahead within skew", Config{Retention: 30 * day}, now.Add(4 * time.Minute), "", false},
		{"ahead past a custom skew", Config{Retention: 30 * day, ClockSkew: time.Second}, now.Add(2 * time.Second), wire.ReasonFutureTimestamp, false},
		{"untimed, default policy, nothing pruned", Config{Retention: 30 * day}, time.Time{}, "", true},
		{"untimed, default policy, after a prune", Config{Retention: 30 * day, NotBefore: now.Add(-10 * day)}, time.Time{}, wire.ReasonMissingTime, false},
		{"untimed, rejected", Config{Retention: 30 * day, Untimed: UntimedReject}, time.Time{}, wire.ReasonMissingTime, false},
		{"before the last prune", Config{Retention: 30 * day, NotBefore: now.Add(-10 * day)}, now.Add(-11 * day), wire.ReasonBeyondRetention, false},
		{"after the last prune", Config{Retention: 30 * day, NotBefore: now.Add(-10 * day)}, now.Add(-9 * day), "", false},
		{"retention by default", Config{}, now.Add(-31 * day), wire.ReasonBeyondRetention, false},
		{"inside the default retention", Config{}, now.Add(-29 * day), "", false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			counted := &countRecorder{}
			cfg := c.cfg
			cfg.URL, cfg.Queue = "amqp://", "q"
			cfg.Observer = counted
			cfg.setDefaults()
			require.NoError(t, cfg.validate())
			cons := &shared[int]{cfg: cfg}
			reason, err := cons.checkTime(c.t, now)
			require.Equal(t, c.reason, reason)
			require.Equal(t, c.reason != "", err != nil)
			if c.counted {
				require.Equal(t, []string{wire.CounterUntimedAccepted}, counted.names)
			} else {
				require.Empty(t, counted.names)
			}
		})
	}
}

// countRecorder is an Observer that records the counters' names.
type countRecorder struct {
	nopObserver
	names []string
}

func (r *countRecorder) Count(name string, _ int) { r.names = append(r.names, name) }
