// Package heartbeat is how a consumer or relay process reports itself to
// the database it works on, so that idem console can show the fleet
// without Prometheus: every few seconds each process upserts its row of
// idem_instance (migrations 0011) with whether it is ready and why not, its
// kill switch, its Redis breaker, and its outcome counts and rates. A
// report that fails is logged once (then again once it works) and never
// touches the work;
// a process that stops cleanly deletes its row, one that dies leaves it to
// go stale, and the console says for how long it has been silent.
package heartbeat

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DefaultEvery is how often a process reports itself.
const DefaultEvery = 5 * time.Second

// Report is one process's state as it reports it.
type Report struct {
	Instance  string // name@host:pid, unique in the fleet
	Kind      string // consumer or relay
	Scope     string
	Queue     string // the stream, for a consumer; the destinations, for a relay
	Version   string
	StartedAt time.Time
	SeenAt    time.Time // the database's clock at the last report
	Every     time.Duration
	Ready     bool
	Why       string // why not ready (the /readyz lines that failed); empty when ready
	TrippedOn string // the kill switch's error class; empty while closed
	Breaker   string // the Redis breaker: closed, open or half-open; empty without Redis
	Counts    map[string]int64
	Rates     map[string]float64 // per second, over the last interval
}

// Silent is how long the report has been silent at now (the database's
// clock), beyond twice its interval; zero while it reports on time.
func (r Report) Silent(now time.Time) time.Duration {
	if d := now.Sub(r.SeenAt); d > 2*r.Every+time.Second {
		return d
	}
	return 0
}

// Instance names one reporter of this process: name@host:pid and a random
// suffix, so that two services of one process, or two containers whose
// processes are all pid 1, never share a row.
func Instance(name string) string {
	host, _ := os.Hostname()
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	return fmt.Sprintf("%s@%s:%d/%x", name, host, os.Getpid(), b)
}

// Forgotten is how long a silent row is kept: a process killed, or whose
// host vanished, never deletes its own. Each reporter deletes such rows
// when it starts.
const Forgotten = 24 * time.Hour

// Version is this binary's module version and VCS revision, as far as the
// build recorded them.
func Version() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	v := bi.Main.Version
	for _, s := range bi.Settings {
		if s.Key == "vcs.revision" && len(s.Value) >= 7 {
			v += " " + s.Value[:7]
		}
	}
	return v
}

// Counter counts outcomes by name; safe for concurrent use, one atomic add
// per count once a name was seen.
type Counter struct {
	mu     sync.RWMutex
	counts map[string]*atomic.Int64
}

// Add adds n to name's count.
func (c *Counter) Add(name string, n int64) {
	c.mu.RLock()
	v := c.counts[name]
	c.mu.RUnlock()
	if v == nil {
		c.mu.Lock()
		if c.counts == nil {
			c.counts = map[string]*atomic.Int64{}
		}
		if v = c.counts[name]; v == nil {
			v = new(atomic.Int64)
			c.counts[name] = v
		}
		c.mu.Unlock()
	}
	v.Add(n)
}

// Snapshot returns every count.
func (c *Counter) Snapshot() map[string]int64 {
	c.mu.RLock()
	defer c.mu.RUnlock()
	out := make(map[string]int64, len(c.counts))
	for k, v := range c.counts {
		out[k] = v.Load()
	}
	return out
}

// DB is what a report is written to.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Run reports every every (DefaultEvery if zero) until ctx ends, then
// deletes the row. state is called for each report: it fills every field
// but Instance, Version, StartedAt, Every, SeenAt and Rates.
func Run(ctx context.Context, db DB, instance string, every time.Duration, state func(context.Context) Report, log *slog.Logger) {
	if every <= 0 {
		every = DefaultEvery
	}
	started, version := time.Now(), Version() // the build's, read once
	{
		dctx, cancel := context.WithTimeout(ctx, every)
		_, _ = db.Exec(dctx, `DELETE FROM idem_instance WHERE seen_at < now() - $1 * interval '1 millisecond'`, Forgotten.Milliseconds())
		cancel()
	}
	var last map[string]int64
	var lastAt time.Time
	failing := false
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		r := state(ctx)
		r.Instance, r.Version, r.StartedAt, r.Every = instance, version, started, every
		now := time.Now()
		r.Rates = map[string]float64{}
		if last != nil {
			secs := now.Sub(lastAt).Seconds()
			for k, v := range r.Counts {
				r.Rates[k] = float64(v-last[k]) / secs
			}
		}
		last, lastAt = maps.Clone(r.Counts), now
		wctx, cancel := context.WithTimeout(ctx, every)
		err := write(wctx, db, r)
		cancel()
		if err != nil && ctx.Err() == nil && !failing {
			// Once, until a write succeeds again: the fleet page misses
			// this process meanwhile (no grant, no idem_instance).
			log.Warn("heartbeat: this process's report for idem console is not written", "err", err)
		}
		if err == nil && failing {
			log.Info("heartbeat: reports written again")
		}
		failing = err != nil
		select {
		case <-ctx.Done():
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			_, _ = db.Exec(dctx, `DELETE FROM idem_instance WHERE instance = $1`, instance)
			cancel()
			return
		case <-t.C:
		}
	}
}

func write(ctx context.Context, db DB, r Report) error {
	counts, err := json.Marshal(r.Counts)
	if err != nil {
		return err
	}
	rates, err := json.Marshal(r.Rates)
	if err != nil {
		return err
	}
	_, err = db.Exec(ctx, `INSERT INTO idem_instance
		(instance, kind, scope, queue, version, started_at, seen_at, every_ms, ready, why, tripped_on, breaker, counts, rates)
	VALUES ($1, $2, $3, $4, $5, $6, now(), $7, $8, $9, $10, $11, $12, $13)
	ON CONFLICT (instance) DO UPDATE SET kind = $2, scope = $3, queue = $4, version = $5, started_at = $6, seen_at = now(),
		every_ms = $7, ready = $8, why = $9, tripped_on = $10, breaker = $11, counts = $12, rates = $13`,
		r.Instance, r.Kind, r.Scope, r.Queue, r.Version, r.StartedAt, r.Every.Milliseconds(), r.Ready, r.Why,
		r.TrippedOn, r.Breaker, counts, rates)
	return err
}

// Querier reads reports.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Read returns every report in db, by kind and instance, and the
// database's clock to judge them by.
func Read(ctx context.Context, db Querier) ([]Report, time.Time, error) {
	rows, err := db.Query(ctx, `SELECT instance, kind, scope, queue, version, started_at, seen_at, every_ms, ready, why,
		tripped_on, breaker, counts, rates, now() FROM idem_instance ORDER BY kind, instance`)
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("read idem_instance: %w", err)
	}
	var now time.Time
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Report, error) {
		var r Report
		var ms int64
		var counts, rates []byte
		err := row.Scan(&r.Instance, &r.Kind, &r.Scope, &r.Queue, &r.Version, &r.StartedAt, &r.SeenAt, &ms, &r.Ready, &r.Why,
			&r.TrippedOn, &r.Breaker, &counts, &rates, &now)
		if err != nil {
			return r, err
		}
		r.Every = time.Duration(ms) * time.Millisecond
		if err := json.Unmarshal(counts, &r.Counts); err != nil {
			return r, err
		}
		return r, json.Unmarshal(rates, &r.Rates)
	})
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("read idem_instance: %w", err)
	}
	if now.IsZero() {
		now = time.Now()
	}
	return out, now, nil
}
