package chaos

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/idemhq/idem/internal/fleet"
	"github.com/idemhq/idem/internal/sandbox"
)

// Fault is one injected fault as it happened.
type Fault struct {
	Kind   Kind    `json:"kind"`
	Start  float64 `json:"start"` // seconds from the start of the run
	End    float64 `json:"end"`
	Detail string  `json:"detail"`
	Err    string  `json:"error,omitempty"` // the fault could not be injected
}

// inject runs the plan: the consumer track and the infrastructure track
// each on their own goroutine, every fault at its planned time or, if the
// track is late, at once.
func (r *run) inject(ctx context.Context, plan []Planned) {
	var cons, infra []Planned
	for _, p := range plan {
		if p.Kind.consumerFault() {
			cons = append(cons, p)
		} else {
			infra = append(infra, p)
		}
	}
	var wg sync.WaitGroup
	for _, track := range [][]Planned{cons, infra} {
		wg.Go(func() {
			for _, p := range track {
				select {
				case <-ctx.Done():
					return
				case <-time.After(time.Until(r.t0.Add(p.At))):
				}
				f := Fault{Kind: p.Kind, Start: r.since()}
				detail, err := r.apply(ctx, p)
				f.End, f.Detail = r.since(), detail
				if err != nil {
					f.Err = err.Error()
					r.logf("fault %s FAILED: %v", p.Kind, err)
				} else {
					r.logf("fault %s: %s", p.Kind, detail)
				}
				r.mu.Lock()
				r.faults = append(r.faults, f)
				r.mu.Unlock()
			}
		})
	}
	wg.Wait()
}

// apply injects one fault and, for a fault with a duration, ends it.
func (r *run) apply(ctx context.Context, p Planned) (string, error) {
	hold := func() {
		select {
		case <-ctx.Done():
		case <-time.After(p.For):
		}
	}
	switch p.Kind {
	case ConsumerKill:
		return "SIGKILL " + r.fleet.kill(p.Slot), nil
	case CrashPoint:
		name, err := r.fleet.arm(p.Slot, p.Step, p.After)
		return fmt.Sprintf("%s armed to SIGKILL itself at %s (pass %d)", name, p.Step, p.After), err
	case RedisKill:
		r.redis.Kill()
		hold()
		return fmt.Sprintf("redis-server killed, down for %s", p.For), r.redis.Start()
	case RedisPause:
		err := r.redis.Pause(ctx, p.For)
		hold()
		return fmt.Sprintf("CLIENT PAUSE %s ALL", p.For), err
	case RedisSlow:
		sctx, cancel := context.WithTimeout(ctx, p.For)
		defer cancel()
		return fmt.Sprintf("DEBUG SLEEP %s in a loop for %s", p.Lag, p.For), r.redis.Slow(sctx, p.Lag)
	case RedisFlush:
		return "FLUSHALL", r.redis.Do(ctx, "FLUSHALL")
	case RedisEvict:
		// 256 KB above what Redis holds now is room for a thousand or so
		// markers: from then on, every write evicts a random key.
		ectx, cancel := context.WithTimeout(ctx, p.For)
		defer cancel()
		return fmt.Sprintf("maxmemory = used + 256kb, allkeys-random, for %s", p.For), r.redis.Evict(ectx, 256<<10, "allkeys-random")
	case PGTerminate:
		var n int
		err := r.pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE application_name = $1) t`, r.appName).Scan(&n)
		return fmt.Sprintf("%d consumer sessions terminated", n), err
	case PGRestart:
		if err := r.pg.Stop(); err != nil {
			return "", err
		}
		hold()
		return fmt.Sprintf("postgres stopped (immediate), down for %s", p.For), r.pg.Start()
	case AMQPClose:
		n, err := sandbox.CloseConnections(r.fleet.prefix, "idem chaos: amqp-close fault")
		if err == nil && n == 0 {
			err = fmt.Errorf("no consumer connection named %s* to close", r.fleet.prefix)
		}
		return fmt.Sprintf("%d consumer connections closed", n), err
	}
	return "", fmt.Errorf("unknown fault kind %q", p.Kind)
}

// Sample is the fleet's state at one moment of the run.
type Sample struct {
	T float64 `json:"t"` // seconds from the start
	// Effects is the ledger rows so far, or -1 when Postgres did not answer.
	Effects int64 `json:"effects"`
	// Deliveries is the outcomes counted by every consumer so far.
	Deliveries int64 `json:"deliveries"`
	// Duplicates caught by each tier so far.
	DupRedis    int64 `json:"dupRedis"`
	DupPostgres int64 `json:"dupPostgres"`
	// BreakerOpen is the consumers whose Redis breaker is open or half-open.
	BreakerOpen int `json:"breakerOpen"`
	// Alive is the consumer processes running.
	Alive int `json:"alive"`
}

// sample records a Sample every half second until ctx ends.
func (r *run) sample(ctx context.Context) {
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	// An exited consumer's counts are final: read them once.
	final := map[*fleet.Proc]map[string]int64{}
	for {
		s := Sample{T: r.since(), Effects: -1, Alive: r.fleet.Alive()}
		qctx, cancel := context.WithTimeout(ctx, 400*time.Millisecond)
		if err := r.pool.QueryRow(qctx, `SELECT count(*) FROM payments_ledger`).Scan(&s.Effects); err != nil {
			s.Effects = -1
		}
		cancel()
		for _, p := range r.fleet.Procs() {
			exited := false
			select {
			case <-p.Done():
				exited = true
			default:
			}
			st, ok := final[p]
			if !ok {
				var err error
				if st, err = p.Stats(); err != nil {
					continue // not written yet
				}
				if exited {
					final[p] = st
				}
			}
			s.Deliveries += deliveries(st)
			s.DupRedis += st["duplicate_redis"]
			s.DupPostgres += st["duplicate_postgres"]
			if !exited && breakerState(st) != "closed" {
				s.BreakerOpen++
			}
		}
		r.mu.Lock()
		r.timeline = append(r.timeline, s)
		r.mu.Unlock()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
