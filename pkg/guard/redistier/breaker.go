package redistier

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/sony/gobreaker/v2"

	"github.com/idemhq/idem/internal/redisfault"
)

// Defaults for BreakerConfig.
const (
	defaultFailureThreshold = 5
	defaultMinOutage        = 250 * time.Millisecond
	defaultOpenTimeout      = 5 * time.Second
	defaultHalfOpenRequests = 1
)

// BreakerConfig configures the circuit breaker that routes around Redis.
type BreakerConfig struct {
	// FailureThreshold is the number of consecutive failed calls that open
	// the breaker, once they have gone on for MinOutage. Defaults to 5.
	FailureThreshold uint32
	// MinOutage is how long calls must have kept failing before the breaker
	// opens. A Redis that is down or stopped fails every call, and opens
	// the breaker after MinOutage; a machine so busy that a few calls in a
	// row miss their deadline, while Redis itself is fine, does not.
	// Defaults to 250ms.
	MinOutage time.Duration
	// OpenTimeout is how long the breaker stays open before letting probe
	// calls through. Defaults to 5s.
	OpenTimeout time.Duration
	// HalfOpenRequests is how many probe calls may run while half-open; that
	// many successes close the breaker. Defaults to 1.
	HalfOpenRequests uint32
	// OnStateChange, if set, is called on every transition with the states'
	// names ("closed", "half-open", "open").
	OnStateChange func(from, to string)
}

func (c *BreakerConfig) setDefaults() {
	if c.FailureThreshold == 0 {
		c.FailureThreshold = defaultFailureThreshold
	}
	if c.MinOutage == 0 {
		c.MinOutage = defaultMinOutage
	}
	if c.OpenTimeout == 0 {
		c.OpenTimeout = defaultOpenTimeout
	}
	if c.HalfOpenRequests == 0 {
		c.HalfOpenRequests = defaultHalfOpenRequests
	}
}

func (c *BreakerConfig) validate() error {
	if c.OpenTimeout < time.Millisecond {
		return fmt.Errorf("redistier: Breaker.OpenTimeout must be at least 1ms, got %s", c.OpenTimeout)
	}
	if c.MinOutage < 0 {
		return fmt.Errorf("redistier: Breaker.MinOutage must not be negative, got %s", c.MinOutage)
	}
	return nil
}

// streak records since when calls have kept failing.
type streak struct {
	since atomic.Int64 // unix nanoseconds of the first failure of the current run; 0 after a success
}

func (s *streak) record(err error) {
	if err == nil {
		s.since.Store(0)
		return
	}
	s.since.CompareAndSwap(0, time.Now().UnixNano())
}

// lasted reports whether the current run of failures has lasted d.
func (s *streak) lasted(d time.Duration) bool {
	since := s.since.Load()
	return since != 0 && time.Since(time.Unix(0, since)) >= d
}

func newBreaker(c BreakerConfig, failing *streak) *gobreaker.CircuitBreaker[struct{}] {
	threshold := c.FailureThreshold
	return gobreaker.NewCircuitBreaker[struct{}](gobreaker.Settings{
		Name:        "redis",
		MaxRequests: c.HalfOpenRequests,
		Timeout:     c.OpenTimeout,
		ReadyToTrip: func(counts gobreaker.Counts) bool {
			return counts.ConsecutiveFailures >= threshold && failing.lasted(c.MinOutage)
		},
		IsExcluded: func(err error) bool { return errors.Is(err, redisfault.ErrCallerGone) },
		OnStateChange: func(_ string, from, to gobreaker.State) {
			if c.OnStateChange != nil {
				c.OnStateChange(from.String(), to.String())
			}
		},
	})
}

// callerGone reports whether ctx ended. A network deadline derived from ctx
// can fire a moment before ctx.Err() turns non-nil, so the deadline is
// compared with the clock as well.
func callerGone(ctx context.Context) bool {
	if ctx.Err() != nil {
		return true
	}
	d, ok := ctx.Deadline()
	return ok && !time.Now().Before(d)
}
