package consumer

import (
	"errors"
	"fmt"
	"time"

	"github.com/idemhq/idem/internal/wire"
)

// checkTime applies the replay horizon early, when a delivery is decoded, to
// an event's time t (zero if it has none) at now, and returns the
// dead-letter reason and cause of a refusal. Rows are pruned by the time
// they were processed, which is never before the event's time (less
// ClockSkew), so an event younger than Retention still has its row. The
// store checks again when it claims the row, however long the delivery was
// held in between.
func (c *shared[T]) checkTime(t, now time.Time) (string, error) {
	cfg := &c.cfg
	if t.IsZero() {
		switch {
		case cfg.Untimed == UntimedReject:
			return wire.ReasonMissingTime, errors.New("the event has no time (no time in its payload and no AMQP timestamp), and consumer.untimed is reject")
		case !cfg.NotBefore.IsZero():
			return wire.ReasonMissingTime, fmt.Errorf("the event has no time (no time in its payload and no AMQP timestamp), and dedup rows were pruned through %s, so it cannot be told from a replay",
				cfg.NotBefore.UTC().Format(time.RFC3339))
		}
		cfg.Observer.Count(wire.CounterUntimedAccepted, 1)
		return "", nil
	}
	if cfg.Retention <= 0 {
		return "", nil
	}
	switch {
	case t.After(now.Add(cfg.ClockSkew)):
		return wire.ReasonFutureTimestamp, fmt.Errorf("event time %s is %s ahead of this consumer's clock (clock_skew %s)",
			t.UTC().Format(time.RFC3339), t.Sub(now).Round(time.Second), cfg.ClockSkew)
	case now.Sub(t) >= cfg.Retention:
		return wire.ReasonBeyondRetention, fmt.Errorf("event time %s is older than the %s retention", t.UTC().Format(time.RFC3339), cfg.Retention)
	case !cfg.NotBefore.IsZero() && t.Before(cfg.NotBefore):
		return wire.ReasonBeyondRetention, fmt.Errorf("event time %s is before %s, where dedup rows were pruned", t.UTC().Format(time.RFC3339), cfg.NotBefore.UTC().Format(time.RFC3339))
	}
	return "", nil
}
