package idem

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/outbox"
)

// relayOn reports whether Run runs a relay.
func (c *Config) relayOn() bool { return len(c.Outbox.Destinations) > 0 && !c.NoRelay }

// relayConns is how many connections a pool opened from DatabaseURL gets
// beyond the consumer's for the relay: a pass's, the listener's while it
// dials (then it leaves the pool), and one for retention and the backlog
// gauges.
func (c *Config) relayConns() int32 {
	if !c.relayOn() {
		return 0
	}
	return 3
}

// relayTx is the longest transaction the relay holds on the service's
// databases; 0 without a relay.
func (c *Config) relayTx() time.Duration {
	if !c.relayOn() {
		return 0
	}
	return relay.Config{PublishTimeout: c.Outbox.PublishTimeout}.TxBound()
}

// openRelay checks the outbox's destinations and builds the relay on the
// service's databases, once they are open; with NoRelay it only checks.
func (s *Service[T]) openRelay() error {
	cfg := &s.cfg
	if len(cfg.Outbox.Destinations) == 0 {
		return nil
	}
	s.destinations = make(map[string]bool, len(cfg.Outbox.Destinations))
	for name := range cfg.Outbox.Destinations {
		s.destinations[name] = true
	}
	rc := cfg.Outbox
	rc.Databases = s.dbs
	rc.AMQPURL = cmp.Or(rc.AMQPURL, cfg.Consumer.URL)
	rc.Name = cmp.Or(rc.Name, cfg.Consumer.ConnectionName+"-relay")
	rc.Logger = cmp.Or(rc.Logger, cfg.Logger)
	if rc.Metrics == nil {
		rc.Metrics = cfg.Metrics
	}
	if cfg.NoRelay {
		rc.Metrics = nil // checked, not run: its metrics are another process's
	}
	r, err := outbox.NewRelay(rc)
	if err != nil {
		return fmt.Errorf("idem: Outbox: %w", err)
	}
	if !cfg.NoRelay {
		s.relay = r
	}
	return nil
}

// startRelay starts the relay, if there is one, beside the consumer. It
// returns the consumer's context, which carries the destinations Enqueue
// checks and ends if the relay cannot start (a queue destination's
// partition count differs from its stream's), and stop, which stops the
// relay and returns why it could not start. Call stop after the
// consumer's drain, so that the relay keeps publishing while it runs. stop
// does not flush the outbox: the relay is cancelled at once, and rows the
// drain committed after its last pass wait for the next pass of any
// instance's relay.
func (s *Service[T]) startRelay(ctx context.Context) (context.Context, func() error) {
	if s.destinations != nil {
		ctx = tier.WithDestinations(ctx, s.destinations)
	}
	if s.relay == nil {
		return ctx, func() error { return nil }
	}
	cctx, stopConsumer := context.WithCancel(ctx)
	rctx, stopRelay := context.WithCancel(context.WithoutCancel(ctx))
	done := make(chan error, 1)
	go func() {
		err := s.relay.Run(rctx)
		if err != nil {
			s.log.Error("the outbox relay cannot start; stopping the service", "err", err)
			stopConsumer()
		}
		done <- err
	}()
	return cctx, func() error {
		stopRelay()
		stopConsumer()
		return <-done
	}
}

// relayChecks are the relay's lines of /readyz, both reported, not
// required: "relay" (its last pass on each database reached it and its
// destinations) and "outbox" (dead rows). A destination that fails says
// nothing of the consumer, which goes on committing its messages to the
// outbox: it must not take every instance out of service.
func (s *Service[T]) relayChecks() []check {
	if s.relay == nil {
		return nil
	}
	return []check{
		{name: "relay", run: func(context.Context) error { return s.relay.Ready() }},
		{name: "outbox", run: func(ctx context.Context) error {
			var errs []string
			for i, db := range s.dbs {
				on := ""
				if len(s.dbs) > 1 {
					on = fmt.Sprintf("shard %d: ", i)
				}
				b, err := relay.ReadBacklog(ctx, db)
				switch {
				case err != nil:
					errs = append(errs, fmt.Sprintf("%scannot read the backlog: %v", on, err))
				case b.Dead > 0:
					errs = append(errs, fmt.Sprintf("%s%d dead row(s) (idem outbox list --dead); %d pending, the oldest %s old",
						on, b.Dead, b.Pending, b.Oldest.Round(time.Millisecond)))
				}
			}
			if len(errs) > 0 {
				return errors.New(strings.Join(errs, "; "))
			}
			return nil
		}},
	}
}
