package idem

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/idemhq/idem/internal/heartbeat"
	"github.com/idemhq/idem/internal/telemetry"
)

// check is one readiness condition: nil when it holds. Required checks
// make /readyz fail; the others are only reported. detail, if set, is
// what the line says after "ok".
type check struct {
	name     string
	required bool
	run      func(ctx context.Context) error
	detail   func() string
}

// checkTimeout bounds each readiness check.
const checkTimeout = time.Second

// slowError marks a required check that did not answer within checkTimeout
// while the work it guards goes on: /readyz reports it as slow, and stays
// ready.
type slowError struct{ err error }

func (e *slowError) Error() string { return e.err.Error() }
func (e *slowError) Unwrap() error { return e.err }

// Health serves the probes: /healthz answers while the process does;
// /readyz answers 200 while the consumer consumes and every database
// answers a ping within a second, or is only slow (no answer, but
// deliveries settle: see progressing), and 503 otherwise (saying why, when
// RabbitMQ refuses the connection or drops it during the handshake, or when
// the kill switch stopped the consumer). Its body has one line per check,
// including those reported but not required: Redis (without it events go
// to Postgres, correctly), the broker blocking publishers or the
// publishing connection away (dead letters wait, acks go on), messages
// stranded in queues outside the stream's layout, and each database's
// standbys as last read, at start and every 30 s
// ("replication": failing when it has standbys and none is synchronous, so
// that an acked event can be lost on failover). With a relay
// (Config.Outbox), /readyz also reports whether it works ("relay": a
// failing destination does not make a consumer that consumes unready) and
// dead outbox rows ("outbox"). The checks run at most once a second per
// handler: requests within that second, or while a run is in flight, get
// that run's answer, so a storm of probes costs the databases nothing
// more. Mount it on the service's own mux, or serve it alone.
func (s *Service[T]) Health() http.Handler {
	return s.health(nil)
}

// health is Health reading the clock now (nil: time.Now).
func (s *Service[T]) health(now func() time.Time) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	ready := telemetry.CacheReady(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ready, body := runChecks(r.Context(), s.checks())
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if !ready {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		fmt.Fprint(w, body)
	}))
	ready.Now = now
	mux.Handle("/readyz", ready)
	return mux
}

func (s *Service[T]) checks() []check {
	return append([]check{
		{name: "consumer", required: true, run: func(context.Context) error {
			st := s.Stats()
			if st.Tripped != "" {
				// Probing or not, a consumer whose events all fail is not
				// ready: /readyz names the error until a probe succeeds.
				return errors.New(st.Tripped)
			}
			if !st.Consuming {
				if st.Refused != "" {
					return fmt.Errorf("not consuming: %s", st.Refused)
				}
				return errors.New("not consuming (starting, or reconnecting to RabbitMQ)")
			}
			return nil
		}},
		{name: "postgres", required: true, run: func(ctx context.Context) error {
			// Every shard: a batch for a shard that is down is held.
			for i, pool := range s.dbs {
				if err := pool.Ping(ctx); err != nil {
					if len(s.dbs) > 1 {
						err = fmt.Errorf("shard %d: %w", i, err)
					}
					if errors.Is(err, context.DeadlineExceeded) {
						if ago, ok := s.progressing(time.Now()); ok {
							return &slowError{fmt.Errorf("no answer to a ping within %s, but work goes on (a delivery settled %s ago): %w",
								checkTimeout, ago.Round(time.Millisecond), err)}
						}
						return fmt.Errorf("no answer to a ping within %s, and no delivery settled within handler_timeout (%s): %w",
							checkTimeout, s.cfg.Consumer.HandlerTimeout, err)
					}
					return err
				}
			}
			return nil
		}},
		{name: "rabbitmq_publishing", run: func(context.Context) error {
			st := s.Stats()
			if st.Blocked != "" {
				return fmt.Errorf("blocked by the broker (%s): dead letters wait, acks go on", st.Blocked)
			}
			if st.Publishing != "" {
				return fmt.Errorf("no publishing connection (%s): dead letters wait, acks go on", st.Publishing)
			}
			return nil
		}},
		{name: "stranded", run: func(context.Context) error {
			if st := s.Stats(); st.Stranded > 0 {
				return fmt.Errorf("%d message(s) in %s, which nobody consumes (a publisher uses another partition count)", st.Stranded, strings.Join(st.StrandedIn, ", "))
			}
			return nil
		}},
		{name: "redis", run: func(ctx context.Context) error {
			if s.rdb == nil {
				return errors.New("not in use (running on Postgres alone)")
			}
			return s.rdb.Ping(ctx).Err()
		}},
		{name: "replication", run: func(context.Context) error {
			_, err := s.repl.Check()
			return err
		}, detail: func() string {
			d, _ := s.repl.Check()
			return d
		}},
	}, s.relayChecks()...)
}

// progressing reports whether the consumer settled a delivery within the
// last Consumer.HandlerTimeout (an attempt that gets its answers settles
// within it), and how long ago. A database that answers no ping within
// checkTimeout while deliveries settle is slow, not away; with nothing
// settled for that long (work stopped, or there is none), an unanswered
// ping cannot be told from a database that is gone.
func (s *Service[T]) progressing(now time.Time) (time.Duration, bool) {
	st := s.Stats()
	if !st.Consuming || st.LastSettled.IsZero() {
		return 0, false
	}
	ago := now.Sub(st.LastSettled)
	return ago, ago <= s.cfg.Consumer.HandlerTimeout
}

// runChecks runs every check at once and reports whether the required ones
// passed, with one line per check.
func runChecks(ctx context.Context, checks []check) (bool, string) {
	ctx, cancel := context.WithTimeout(ctx, checkTimeout)
	defer cancel()
	errs := make([]chan error, len(checks))
	for i, c := range checks {
		errs[i] = make(chan error, 1)
		go func() { errs[i] <- c.run(ctx) }()
	}
	ready := true
	var b strings.Builder
	for i, c := range checks {
		err := <-errs[i]
		var slow *slowError
		switch {
		case errors.As(err, &slow):
			fmt.Fprintf(&b, "%s: slow: %v\n", c.name, slow)
		case err == nil && c.detail != nil:
			fmt.Fprintf(&b, "%s: ok: %s\n", c.name, c.detail())
		case err == nil:
			fmt.Fprintf(&b, "%s: ok\n", c.name)
		case c.required:
			ready = false
			fmt.Fprintf(&b, "%s: failing: %v\n", c.name, err)
		default:
			fmt.Fprintf(&b, "%s: failing (not required): %v\n", c.name, err)
		}
	}
	if ready {
		return true, "ready\n" + b.String()
	}
	return false, "not ready\n" + b.String()
}

// report is the service's heartbeat: its /readyz checks, kill switch,
// Redis breaker and outcome counts.
func (s *Service[T]) report(ctx context.Context) heartbeat.Report {
	kind := "consumer"
	if s.relay != nil {
		kind = "consumer+relay"
	}
	// The required checks only: the others (a backlog count, replication)
	// are /readyz's, and need not run every heartbeat.
	var required []check
	for _, c := range s.checks() {
		if c.required {
			required = append(required, c)
		}
	}
	ready, body := runChecks(ctx, required)
	var why []string
	if !ready {
		for _, line := range strings.Split(body, "\n") {
			if strings.Contains(line, ": failing: ") {
				why = append(why, line)
			}
		}
	}
	r := heartbeat.Report{Kind: kind, Scope: s.cfg.Scope, Queue: s.cfg.Consumer.Queue, Ready: ready,
		Why: strings.Join(why, "\n"), TrippedOn: s.Stats().TrippedOn, Counts: s.outcomes.Snapshot()}
	if s.fast != nil {
		r.Breaker = s.fast.BreakerState()
	}
	return r
}
