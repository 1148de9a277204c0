package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/sony/gobreaker/v2"
)

// PauseRows is how many distinct rows of one destination, one after
// another with no answer on a row's merits between them (a 2xx, or a final
// answer) nor for 10×BackoffMin before them, failing in the same class,
// pause the destination: its rows stay pending, no attempt is spent, and
// the relay probes with one row on a backoff (BackoffMin doubling to
// BackoffMax) until one is answered on its merits. A failed probe's row
// waits that backoff too, so that the next probe is another row: a row
// that fails on its own cannot keep a destination that works paused.
//
// A class is what the destination, not a row, is at fault for: an HTTP
// status that is not final (401 and 403 by default, each its own class),
// an API down or overloaded (a 5xx, 408, 425, 429, or no answer at all:
// one class, as such an API mixes them), a message the broker returned
// unroutable, nacked, or refused by closing the channel.
const PauseRows = 5

// pauses holds a relay's breaker per destination (gobreaker's two-step
// breaker: closed while rows pass, open while paused, half-open for one
// probe row).
type pauses struct {
	relay    string
	db       *pgxpool.Pool
	min, max time.Duration
	window   time.Duration // a failure within this of an answer on a row's merits never counts
	metrics  *Metrics
	log      *slog.Logger

	mu sync.Mutex
	by map[string]*pause
}

// pause is one destination's breaker and what the relay knows of it.
type pause struct {
	name string
	cb   *gobreaker.TwoStepCircuitBreaker[struct{}]

	mu      sync.Mutex // never held while calling cb: its state changes call back
	class   string     // the class of the failures in a row, or of the pause
	rows    map[int64]bool
	last    string    // the last failure in class
	since   time.Time // paused since; zero while not paused
	probes  int       // failed probes since the pause
	next    time.Time // no probe before this
	changed bool      // state changed since the last record
	merit   time.Time // the last answer on a row's merits
	swept   time.Time // when record last deleted the destination's pause rows while it worked
}

// Pause is a paused destination as Ready and idem outbox list show it.
type Pause struct {
	Destination string
	Relay       string
	Class       string // what the rows failed with, alike
	LastError   string
	Since       time.Time
	NextProbe   time.Time
	Probes      int // failed probes since it paused
}

func (p Pause) String() string {
	return fmt.Sprintf("destination %s paused %s ago: %d rows in a row failed alike (%s; the last: %s); %d probe(s) failed, the next in %s",
		p.Destination, time.Since(p.Since).Round(time.Second), PauseRows, p.Class, p.LastError, p.Probes,
		max(time.Until(p.NextProbe), 0).Round(100*time.Millisecond))
}

func newPauses(cfg Config, relayName string) *pauses {
	ps := &pauses{relay: relayName, db: cfg.DB, min: cfg.BackoffMin, max: cfg.BackoffMax, window: 10 * cfg.BackoffMin, metrics: cfg.Metrics,
		log: cfg.Logger, by: map[string]*pause{}}
	for name := range cfg.Destinations {
		ps.by[name] = ps.newPause(name)
	}
	return ps
}

// errExcluded tells a breaker a row had no answer: it counts neither way.
var errExcluded = errors.New("no answer")

func (ps *pauses) newPause(name string) *pause {
	p := &pause{name: name, rows: map[int64]bool{}}
	p.cb = gobreaker.NewTwoStepCircuitBreaker[struct{}](gobreaker.Settings{
		Name:        name,
		MaxRequests: 1, // one probe row at a time
		Timeout:     ps.min,
		ReadyToTrip: func(gobreaker.Counts) bool {
			p.mu.Lock()
			defer p.mu.Unlock()
			return len(p.rows) >= PauseRows
		},
		IsExcluded: func(err error) bool { return err == errExcluded },
		OnStateChange: func(_ string, from, to gobreaker.State) {
			p.mu.Lock()
			defer p.mu.Unlock()
			now := time.Now()
			switch {
			case to == gobreaker.StateOpen && from == gobreaker.StateClosed:
				p.since, p.probes, p.changed = now, 0, true
				p.next = now.Add(jitter(ps.min))
				ps.metrics.paused(name, true)
				ps.log.Error("outbox destination paused: its rows stay pending and spend no attempt; probing with one row",
					"destination", name, "class", p.class, "last_error", p.last, "rows", len(p.rows), "next_probe", p.next.Sub(now).Round(time.Millisecond))
			case to == gobreaker.StateOpen: // a probe failed
				p.probes++
				p.changed = true
				d := ps.min
				for i := 0; i < p.probes && d < ps.max; i++ {
					d *= 2
				}
				p.next = now.Add(jitter(min(d, ps.max)))
				ps.log.Warn("outbox destination still paused: the probe failed", "destination", name, "class", p.class,
					"last_error", p.last, "probes", p.probes, "next_probe", p.next.Sub(now).Round(time.Millisecond))
			case to == gobreaker.StateClosed:
				ps.log.Info("outbox destination resumed: a probe was answered", "destination", name,
					"paused_for", now.Sub(p.since).Round(time.Millisecond), "probes", p.probes+1)
				p.since, p.class, p.last, p.rows, p.changed = time.Time{}, "", "", map[int64]bool{}, true
				ps.metrics.paused(name, false)
			}
		},
	})
	return p
}

func (ps *pauses) get(name string) *pause {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	return ps.by[name]
}

// held reports whether p's rows wait: paused, and no probe due yet.
func (p *pause) held(now time.Time) bool {
	switch p.cb.State() {
	case gobreaker.StateOpen:
		return true
	case gobreaker.StateHalfOpen:
		p.mu.Lock()
		defer p.mu.Unlock()
		return now.Before(p.next)
	}
	return false
}

// Held returns the destinations whose rows a pass leaves unclaimed now:
// paused, their next probe not yet due. Never nil (the claim's array).
func (ps *pauses) Held() []string {
	out := []string{}
	now := time.Now()
	ps.mu.Lock()
	all := make([]*pause, 0, len(ps.by))
	for _, p := range ps.by {
		all = append(all, p)
	}
	ps.mu.Unlock()
	for _, p := range all {
		if p.held(now) {
			out = append(out, p.name)
		}
	}
	sort.Strings(out)
	return out
}

// Paused lists the destinations paused now.
func (ps *pauses) Paused() []Pause {
	ps.mu.Lock()
	all := make([]*pause, 0, len(ps.by))
	for _, p := range ps.by {
		all = append(all, p)
	}
	ps.mu.Unlock()
	var out []Pause
	for _, p := range all {
		if p.cb.State() == gobreaker.StateClosed {
			continue
		}
		p.mu.Lock()
		out = append(out, Pause{Destination: p.name, Relay: ps.relay, Class: p.class, LastError: p.last,
			Since: p.since, NextProbe: p.next, Probes: p.probes})
		p.mu.Unlock()
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Destination < out[j].Destination })
	return out
}

// admit asks each row's destination's breaker whether the row may be sent
// and returns the callbacks that take the answers; a row its destination
// holds back is skipped, its attempts untouched. Rows of an unknown
// destination have no breaker.
func (ps *pauses) admit(rows []*row, results []result) []func(error) {
	dones := make([]func(error), len(rows))
	now := time.Now()
	for i, w := range rows {
		p := ps.get(w.destination)
		if p == nil {
			continue
		}
		if p.held(now) {
			results[i] = result{skipped: true, paused: true}
			continue
		}
		done, err := p.cb.Allow()
		if err != nil { // open, or half-open with its probe out
			results[i] = result{skipped: true, paused: true}
			continue
		}
		dones[i] = done
	}
	return dones
}

// judge tells each admitted row's breaker how the row fared, in id order.
// A failure counts only when its destination answered no row on its merits
// in this pass nor within the window before: rows that fail beside rows
// that pass fail on their own. The failures of a destination that paused
// in this pass (a failed probe included) are taken back: those rows are
// skipped instead, the destination's fault, not theirs, so they spend no
// attempt; a failed probe's row waits for the next probe, so that the next
// is another row.
func (ps *pauses) judge(rows []*row, results []result, dones []func(error)) {
	now := time.Now()
	for i, w := range rows {
		if dones[i] != nil && (results[i].sent || results[i].final) {
			p := ps.get(w.destination)
			p.mu.Lock()
			p.merit = now
			p.mu.Unlock()
		}
	}
	var failedIn map[string][]int
	for i, w := range rows {
		done := dones[i]
		if done == nil {
			continue
		}
		res := results[i]
		p := ps.get(w.destination)
		switch {
		case res.skipped:
			done(errExcluded)
		case res.sent, res.final:
			// An answer on the row's merits: the destination works.
			p.mu.Lock()
			p.class, p.last, p.rows = "", "", map[int64]bool{}
			p.mu.Unlock()
			done(nil)
		case res.class == "":
			done(errExcluded) // the row's own fault, without an answer (it cannot be encoded)
		default:
			p.mu.Lock()
			if !p.merit.IsZero() && now.Sub(p.merit) < ps.window {
				p.mu.Unlock()
				done(errExcluded) // its neighbours pass: its own failure
				continue
			}
			if p.class != res.class && p.since.IsZero() {
				p.class, p.rows = res.class, map[int64]bool{}
			}
			if p.since.IsZero() || p.class == res.class {
				p.rows[w.id] = true
			}
			p.class, p.last = res.class, storable(res.err.Error(), 300)
			p.mu.Unlock()
			done(res.err)
			if failedIn == nil {
				failedIn = map[string][]int{}
			}
			failedIn[w.destination] = append(failedIn[w.destination], i)
		}
	}
	for name, idx := range failedIn {
		p := ps.get(name)
		if p.cb.State() != gobreaker.StateOpen {
			continue
		}
		p.mu.Lock()
		wait, probe := max(time.Until(p.next), 0), p.probes > 0
		p.mu.Unlock()
		if probe {
			// A failed probe's row waits past the next probe, so that the
			// next is another row (this one may fail on its own).
			wait = max(wait, ps.max)
		}
		for _, i := range idx {
			results[i] = result{skipped: true, paused: true, postpone: wait}
		}
	}
}

// record writes the pauses that changed to idem_outbox_pause, for idem
// outbox list and other relays' operators; a resumed destination's rows go.
// Best effort: the pause holds whatever the database says.
func (ps *pauses) record(ctx context.Context) {
	ps.mu.Lock()
	all := make([]*pause, 0, len(ps.by))
	for _, p := range ps.by {
		all = append(all, p)
	}
	ps.mu.Unlock()
	now := time.Now()
	for _, p := range all {
		p.mu.Lock()
		// A destination that works here (answered on a row's merits since
		// the last sweep, not paused) has no pause to show, whatever relay
		// wrote one and then died or was restarted: swept every
		// sweepEvery at most.
		if p.since.IsZero() && p.merit.After(p.swept) && now.Sub(p.swept) >= sweepEvery {
			p.swept, p.changed = now, true
		}
		changed, paused := p.changed, !p.since.IsZero()
		rec := Pause{Destination: p.name, Relay: ps.relay, Class: p.class, LastError: p.last, Since: p.since, NextProbe: p.next, Probes: p.probes}
		p.changed = false
		p.mu.Unlock()
		if !changed {
			continue
		}
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		var err error
		if paused {
			_, err = ps.db.Exec(rctx, `INSERT INTO idem_outbox_pause (destination, relay, class, last_error, since, next_probe, probes, updated_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, clock_timestamp())
ON CONFLICT (destination, relay) DO UPDATE SET class = EXCLUDED.class, last_error = EXCLUDED.last_error, since = EXCLUDED.since,
	next_probe = EXCLUDED.next_probe, probes = EXCLUDED.probes, updated_at = EXCLUDED.updated_at`,
				rec.Destination, rec.Relay, rec.Class, rec.LastError, rec.Since, rec.NextProbe, rec.Probes)
		} else {
			// The destination answered: whatever relay paused it, it works.
			_, err = ps.db.Exec(rctx, `DELETE FROM idem_outbox_pause WHERE destination = $1`, rec.Destination)
		}
		cancel()
		if err != nil {
			p.mu.Lock()
			p.changed = true // try again after the next pass
			p.mu.Unlock()
			if ctx.Err() == nil {
				ps.log.Warn("recording an outbox destination's pause failed; will retry", "destination", p.name, "err", err)
			}
		}
	}
}

// sweepEvery is how often a relay to which a destination answers deletes
// the destination's pause rows, at most.
const sweepEvery = 10 * time.Second

// clearOwn deletes the pause rows this relay's name wrote before (a
// restart's): it starts with every destination closed.
func (ps *pauses) clearOwn(ctx context.Context) {
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if _, err := ps.db.Exec(rctx, `DELETE FROM idem_outbox_pause WHERE relay = $1`, ps.relay); err != nil && ctx.Err() == nil {
		ps.log.Debug("clearing this relay's old outbox pauses", "err", err)
	}
}

// ReadPauses lists idem_outbox_pause: the destinations relays paused, with
// when each row was last written.
func ReadPauses(ctx context.Context, db queryer) ([]Pause, []time.Time, error) {
	rs, err := db.Query(ctx, `SELECT destination, relay, class, last_error, since, next_probe, probes, updated_at
FROM idem_outbox_pause ORDER BY destination, relay`)
	if err != nil {
		return nil, nil, err
	}
	defer rs.Close()
	var out []Pause
	var updated []time.Time
	for rs.Next() {
		var p Pause
		var u time.Time
		if err := rs.Scan(&p.Destination, &p.Relay, &p.Class, &p.LastError, &p.Since, &p.NextProbe, &p.Probes, &u); err != nil {
			return nil, nil, err
		}
		out, updated = append(out, p), append(updated, u)
	}
	return out, updated, rs.Err()
}
