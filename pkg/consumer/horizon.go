package consumer

import (
	"fmt"
	"time"
)

// checkTime applies the replay horizon to an event's time t (zero if it has
// none) at now, and returns the dead-letter reason and cause of a refusal.
// Rows are pruned by the time they were processed, which is never before the
// event's time (less ClockSkew), so an event younger than Retention still
// has its row.
func (c *Consumer[T]) checkTime(t, now time.Time) (string, error) {
	cfg := &c.cfg
	if cfg.Retention <= 0 {
		return "", nil
	}
	switch {
	case t.IsZero():
		if cfg.Untimed == UntimedAccept {
			cfg.Observer.Count(CounterUntimedAccepted, 1)
			return "", nil
		}
		return ReasonMissingTime, fmt.Errorf("the event has no time (no occurredAt and no AMQP timestamp), so its age cannot be checked against the %s retention", cfg.Retention)
	case t.After(now.Add(cfg.ClockSkew)):
		return ReasonFutureTimestamp, fmt.Errorf("event time %s is %s ahead of this consumer's clock (clock_skew %s)",
			t.UTC().Format(time.RFC3339), t.Sub(now).Round(time.Second), cfg.ClockSkew)
	case now.Sub(t) >= cfg.Retention:
		return ReasonBeyondRetention, fmt.Errorf("event time %s is older than the %s retention", t.UTC().Format(time.RFC3339), cfg.Retention)
	case !cfg.NotBefore.IsZero() && t.Before(cfg.NotBefore):
		return ReasonBeyondRetention, fmt.Errorf("event time %s is before %s, where dedup rows were pruned", t.UTC().Format(time.RFC3339), cfg.NotBefore.UTC().Format(time.RFC3339))
	}
	return "", nil
}
