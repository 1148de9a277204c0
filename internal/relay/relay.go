// Package relay publishes the outbox (package outbox's idem_outbox rows) to
// their destinations: the loop of outbox.Relay (which the front door runs
// with idem.Config.Outbox), of idem relay, and of outbox.relay in idem
// consume.
//
// A pass takes a few lanes (rows of idem_outbox_lane, FOR UPDATE SKIP
// LOCKED, so that relays share the lanes out), reads the oldest pending
// rows of those lanes in id order (the lane's lock is theirs: one relay at
// a time publishes a lane's rows), publishes them, and marks the
// confirmed ones sent in the same transaction. A relay that
// dies before the commit leaves the rows pending and another publishes them
// again, with the same message IDs. Rows are read by their state, never
// past a cursor, so a transaction that commits after a later one is not
// skipped.
package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/internal/pgsession"
	"github.com/idemhq/idem/internal/step"
)

// maxPassBackoff caps the wait after a pass that could not reach the
// database or the broker: short, since it spends no row's attempts.
const maxPassBackoff = 10 * time.Second

// Lanes is how many lanes idem_outbox_lane holds (migration 0008); the rows
// of one key share one.
const Lanes = 32

// Config configures a Relay.
type Config struct {
	// DB holds idem_outbox. Required.
	DB *pgxpool.Pool
	// AMQPURLs are the broker's nodes, for queue and exchange destinations.
	AMQPURLs []string
	// Destinations maps the names messages are enqueued To. A row whose
	// destination is not here is dead at once, to be replayed once it is.
	Destinations map[string]Destination
	// Name names the relay's AMQP connection.
	Name string
	// BatchSize is the most rows one pass claims. Defaults to 500.
	BatchSize int
	// LanesPerPass is how many of the Lanes a pass takes; a relay runs
	// through all of them in ⌈Lanes/LanesPerPass⌉ passes, and relays
	// running side by side take different ones. Defaults to 8.
	LanesPerPass int
	// PollInterval is how often an idle relay looks for rows without a
	// notification. Defaults to 1s.
	PollInterval time.Duration
	// MaxAttempts is how many failed publishes make a row dead. Defaults
	// to 20.
	MaxAttempts int
	// BackoffMin and BackoffMax bound the wait before a failed row is tried
	// again (doubling per attempt, jittered). Default 1s and 5m.
	BackoffMin, BackoffMax time.Duration
	// PublishTimeout bounds a pass's wait for the broker's confirms and
	// one HTTP request. Defaults to 10s.
	PublishTimeout time.Duration
	// DoneStatus, if set, is an HTTP status that a destination answers
	// for a key whose request it already completed, and counts as sent
	// like a 2xx.
	DoneStatus int
	// Retention is how long sent rows are kept for idem inspect; 0
	// deletes a row as soon as it is sent. Defaults to 0.
	Retention time.Duration
	// Metrics, if set, records the relay's work.
	Metrics *Metrics
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// TxBound is the longest a pass's transaction lasts (PublishTimeout and a
// second): the session bound (pgsession.Bounds.Tx) of a pool a relay uses.
func (c Config) TxBound() time.Duration { return c.WithDefaults().PublishTimeout + passSlack }

// WithDefaults returns c with its zero tuning fields set to their defaults.
func (c Config) WithDefaults() Config {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	defDur := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	def(&c.BatchSize, 500)
	def(&c.LanesPerPass, 8)
	def(&c.MaxAttempts, 20)
	defDur(&c.PollInterval, time.Second)
	defDur(&c.BackoffMin, time.Second)
	defDur(&c.BackoffMax, 5*time.Minute)
	defDur(&c.PublishTimeout, 10*time.Second)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Relay publishes the outbox. Create it with New, run it with Run.
type Relay struct {
	cfg    Config
	log    *slog.Logger
	amqp   *amqpPublisher
	http   *httpSender
	lane   int // the first lane of the next pass
	ready  atomic.Value
	pauses *pauses
}

// New checks cfg and returns a Relay.
func New(cfg Config) (*Relay, error) {
	cfg = cfg.WithDefaults()
	switch {
	case cfg.DB == nil:
		return nil, errors.New("relay: DB is required")
	case cfg.LanesPerPass < 1 || cfg.LanesPerPass > Lanes:
		return nil, fmt.Errorf("relay: LanesPerPass must be 1 to %d", Lanes)
	case cfg.BatchSize < 1 || cfg.BatchSize > 4096:
		return nil, errors.New("relay: BatchSize must be 1 to 4096")
	case cfg.MaxAttempts < 1:
		return nil, errors.New("relay: MaxAttempts must be at least 1")
	case cfg.BackoffMin > cfg.BackoffMax:
		return nil, errors.New("relay: BackoffMin above BackoffMax")
	}
	r := &Relay{cfg: cfg, log: cfg.Logger, lane: rand.IntN(Lanes)}
	for _, d := range cfg.Destinations {
		if d.Kind != HTTP && len(cfg.AMQPURLs) == 0 {
			return nil, fmt.Errorf("relay: destination %s needs an AMQP URL", d.Name)
		}
	}
	r.amqp = &amqpPublisher{urls: cfg.AMQPURLs, name: cfg.Name, metrics: cfg.Metrics}
	r.pauses = newPauses(cfg, r.amqp.connName())
	r.http = newHTTPSender(cfg.PublishTimeout, cfg.DoneStatus)
	r.ready.Store("not started")
	return r, nil
}

// Ready returns nil once a pass has run, the last one reached the
// database, the last one with rows reached their destinations (their
// request hooks too), the broker has not refused the relay's connection
// lately, and no destination is paused; otherwise why not.
func (r *Relay) Ready() error {
	var errs []error
	if s := r.ready.Load().(string); s != "" {
		errs = append(errs, errors.New(s))
	}
	errs = append(errs, r.amqp.lastRefusal())
	for _, p := range r.pauses.Paused() {
		errs = append(errs, errors.New(p.String()))
	}
	return errors.Join(errs...)
}

// Paused lists the destinations this relay has paused now (PauseRows).
func (r *Relay) Paused() []Pause { return r.pauses.Paused() }

// Run relays until ctx ends. It returns nil then, once its helpers (the
// listener, retention, the metrics' watch) have ended; other errors come
// only from the start.
func (r *Relay) Run(ctx context.Context) error {
	defer r.amqp.closeAll()
	hctx, stopHelpers := context.WithCancel(ctx)
	var helpers sync.WaitGroup
	defer func() { stopHelpers(); helpers.Wait() }()
	// A pool that prepares named statements behind a transaction-mode
	// pooler would fail its statements now and then: refused, with what
	// to set (idem's own pools adapt; see pgsession.Apply).
	if err := pgsession.CheckPool(ctx, r.cfg.DB); errors.Is(err, pgsession.ErrPooledStatements) {
		return fmt.Errorf("relay: %w (in pgx: ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe)", err)
	}
	wake := make(chan struct{}, 1)
	r.pauses.clearOwn(ctx)
	helpers.Go(func() { listen(hctx, r.cfg.DB, wake, r.log) })
	helpers.Go(func() { r.retain(hctx) })
	if r.cfg.Metrics != nil {
		helpers.Go(func() { r.cfg.Metrics.watch(hctx, r.cfg.DB, r.log) })
	}
	backoff := r.cfg.BackoffMin
	idle := 0      // passes in a row that found nothing
	fruitless := 0 // passes in a row that claimed rows and sent none, all refused
	// A pass that claims nothing (its lanes empty, or their rows waiting
	// out a backoff) says nothing of the destinations: what the last pass
	// with rows found stands until the next.
	var unreached error   // that pass could not reach a destination, or a request hook failed
	var lastRefused error // the last publish a destination refused
	for ctx.Err() == nil {
		p, err := r.pass(ctx)
		if ctx.Err() != nil {
			break
		}
		r.pauses.record(ctx)
		if p.lastErr != nil {
			lastRefused = p.lastErr
		}
		if p.claimed > 0 {
			unreached = err
			switch {
			case err != nil: // its answers say nothing of the rows it did not reach
			case p.sent > 0 || p.failed == 0:
				fruitless = 0
			default:
				fruitless++
			}
		}
		switch {
		case err != nil:
			r.ready.Store(err.Error())
		case unreached != nil:
			r.ready.Store(unreached.Error())
		case fruitless >= fruitlessPasses:
			// Every destination answers, and refuses everything: the
			// rows are not lost (they retry, then go dead), but the
			// relay is not doing its job and must say so.
			r.ready.Store(fmt.Sprintf("the last %d passes sent nothing: every publish failed (the last: %v)", fruitless, lastRefused))
		default:
			r.ready.Store("")
		}
		if err != nil {
			r.log.Warn("relay pass failed; retrying", "err", err, "in", backoff)
			sleep(ctx, jitter(backoff))
			backoff = min(2*backoff, max(r.cfg.BackoffMin, maxPassBackoff))
			continue
		}
		backoff = r.cfg.BackoffMin
		if p.claimed > 0 {
			idle = 0
			continue
		}
		// A round of empty passes covers every lane, wherever it began:
		// ⌈Lanes/LanesPerPass⌉ of them (⌊ ⌋ left the two lanes before a
		// round's first out of it when 5 a pass, say, until the next poll).
		if idle++; idle < (Lanes+r.cfg.LanesPerPass-1)/r.cfg.LanesPerPass {
			continue // the other lanes may hold rows
		}
		idle = 0
		select {
		case <-ctx.Done():
		case <-wake:
		case <-time.After(r.cfg.PollInterval):
		}
	}
	return nil
}

// fruitlessPasses is how many passes in a row that sent nothing, every
// publish refused, make the relay not ready.
const fruitlessPasses = 3

// passResult sums up a pass: rows claimed, sent, failed (their attempt
// spent), and the last failure.
type passResult struct {
	claimed, sent, failed int
	lastErr               error
}

// row is a claimed idem_outbox row.
type row struct {
	id                           int64
	scope, eventID               string
	idx                          int
	destination, key, typ, ctype string
	body                         []byte
	attempts                     int
	created                      time.Time
	eventAt                      *time.Time    // the sending event's time; nil: untimed
	age                          time.Duration // at the claim, by the database's clock
}

func (w *row) messageID() string { return MessageID(w.scope, w.eventID, w.idx) }

// sourceTime is the sending event's time as the relay sends it
// (x-idem-source-time, X-Idem-Source-Time): RFC 3339 with nanoseconds, in
// UTC; empty when the event was untimed.
func (w *row) sourceTime() string {
	if w.eventAt == nil {
		return ""
	}
	return w.eventAt.UTC().Format(time.RFC3339Nano)
}

// HeaderSourceTime is the AMQP header a relayed message carries the sending
// event's time in (HTTP: X-Idem-Source-Time).
const HeaderSourceTime = "x-idem-source-time"

// result is how a row's publish ended.
type result struct {
	sent  bool
	err   error // the failure, when not sent
	final bool  // the failure will not pass: dead at once
	after time.Duration
	// class, for a failure that is the destination's fault rather than
	// the row's: what it counts as towards a pause (PauseRows).
	class string
	// skipped: not tried (an earlier row of its key failed, or the
	// destination could not be reached, or is paused); the row stays as
	// it was.
	skipped bool
	// paused, with skipped: its destination is paused (or paused as it
	// failed).
	paused bool
	// postpone, with skipped: how long the row waits before it is due
	// again (a failed probe's), its attempts untouched.
	postpone time.Duration
	// held, with skipped: why the row was not sent though its destination
	// may be fine (its request hook failed), for the pass to report.
	held error
}

// lockLanes takes the lanes of $1 that no other relay holds, until the
// pass's transaction ends.
const lockLanes = `SELECT coalesce(array_agg(lane), '{}') FROM (
	SELECT lane FROM idem_outbox_lane WHERE lane = ANY($1::smallint[]) FOR UPDATE SKIP LOCKED
) l`

// claim reads up to $1 pending rows, due now, of the lanes the pass holds
// ($2), but those of the destinations paused with no probe due ($3). It
// locks no row: a pending row is only ever published by the relay that
// holds its lane, and only marked by that relay's pass (the tools change
// dead rows, or lock every lane first: Resend). It runs after lockLanes,
// in a statement of its own of a READ COMMITTED transaction, so that its
// snapshot is taken once the lanes are held, and sees every row the lanes'
// last holder marked or deleted. (Under REPEATABLE READ, a database's
// default some set, the snapshot would be lockLanes's, taken before a lane
// its holder released meanwhile: the rows it had just sent would be sent
// again.)
const claim = `SELECT o.id, o.scope, o.event_id, o.idx, o.destination, o.key, o.type, o.content_type, o.body, o.attempts, o.created_at,
	(extract(epoch FROM clock_timestamp() - o.created_at) * 1e6)::bigint, o.event_at
FROM idem_outbox o
WHERE o.state = 'pending' AND o.next_at <= now() AND o.lane = ANY($2::smallint[])
	AND o.destination <> ALL($3::text[])
ORDER BY o.id LIMIT $1`

// pass claims, publishes and marks one batch.
func (r *Relay) pass(ctx context.Context) (passResult, error) {
	lanes := make([]int16, r.cfg.LanesPerPass)
	for i := range lanes {
		lanes[i] = int16((r.lane + i) % Lanes)
	}
	r.lane = (r.lane + r.cfg.LanesPerPass) % Lanes

	// READ COMMITTED whatever the database's default: the claim's
	// snapshot must be taken after lockLanes holds the lanes (see claim).
	tx, err := r.cfg.DB.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return passResult{}, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	rows, err := r.claim(ctx, tx, lanes)
	if err != nil || len(rows) == 0 {
		return passResult{}, err
	}
	claimed := time.Now()
	results, pubErr := r.publish(ctx, rows)
	step.Reached(ctx, step.RelayPublished)
	if err := r.mark(ctx, tx, rows, results); err != nil {
		return passResult{}, err
	}
	if err := tx.Commit(ctx); err != nil {
		return passResult{}, fmt.Errorf("commit: %w", err)
	}
	step.Reached(ctx, step.RelayMarked)
	r.observe(rows, results, time.Since(claimed))
	p := passResult{claimed: len(rows)}
	for _, res := range results {
		switch {
		case res.sent:
			p.sent++
		case !res.skipped:
			p.failed++
			p.lastErr = res.err
		}
	}
	return p, pubErr
}

// claim takes the lanes no other relay holds of lanes, then reads their
// rows.
func (r *Relay) claim(ctx context.Context, tx pgx.Tx, lanes []int16) ([]*row, error) {
	var held []int16
	if err := tx.QueryRow(ctx, lockLanes, lanes).Scan(&held); err != nil {
		return nil, fmt.Errorf("claim: lanes: %w", err)
	}
	if len(held) == 0 {
		return nil, nil // other relays hold them all
	}
	rs, err := tx.Query(ctx, claim, r.cfg.BatchSize, held, r.pauses.Held())
	if err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	var out []*row
	var ageMicros int64
	for rs.Next() {
		w := &row{}
		if err := rs.Scan(&w.id, &w.scope, &w.eventID, &w.idx, &w.destination, &w.key, &w.typ, &w.ctype, &w.body,
			&w.attempts, &w.created, &ageMicros, &w.eventAt); err != nil {
			rs.Close()
			return nil, fmt.Errorf("claim: %w", err)
		}
		w.age = time.Duration(ageMicros) * time.Microsecond
		out = append(out, w)
	}
	if err := rs.Err(); err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	return out, nil
}

// publish sends every row to its destination and returns each row's
// result. The error, if any, is a destination that could not be reached,
// or a request hook that failed (their rows are skipped, not failed).
func (r *Relay) publish(ctx context.Context, rows []*row) ([]result, error) {
	results := make([]result, len(rows))
	dones := r.pauses.admit(rows, results)
	var amqpRows, httpRows []int
	for i, w := range rows {
		d, ok := r.cfg.Destinations[w.destination]
		switch {
		case results[i].paused:
		case !ok:
			results[i] = result{err: fmt.Errorf("no destination %q in outbox.destinations", w.destination), final: true}
		case d.Kind == HTTP:
			httpRows = append(httpRows, i)
		default:
			amqpRows = append(amqpRows, i)
		}
	}
	// The pass holds its transaction and its lanes' locks while it
	// publishes: whatever the destinations do, that lasts at most
	// PublishTimeout (and a second, so that a request sent at once meets
	// its own timeout, which spends an attempt, before the pass's, which
	// spends none). What the pass did not reach waits for the next.
	pctx, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout+passSlack)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.http.sendAll(pctx, r.cfg.Destinations, rows, httpRows, results) }()
	var errs []error
	if len(amqpRows) > 0 {
		actx, cancel := context.WithTimeout(pctx, r.cfg.PublishTimeout)
		errs = append(errs, r.amqp.publishAll(actx, r.cfg.Destinations, rows, amqpRows, results))
		cancel()
	}
	errs = append(errs, <-done)
	r.pauses.judge(rows, results, dones)
	return results, errors.Join(errs...)
}

// passSlack is how long a pass's publishing may outlast PublishTimeout.
const passSlack = time.Second

// markSent and markFailed record a pass's results.
const (
	markSent   = `UPDATE idem_outbox SET state = 'sent', sent_at = clock_timestamp(), attempts = attempts + 1, last_error = NULL WHERE id = ANY($1)`
	deleteSent = `DELETE FROM idem_outbox WHERE id = ANY($1)`
	markFailed = `UPDATE idem_outbox o SET attempts = o.attempts + 1, last_error = f.err,
	state = CASE WHEN f.final OR o.attempts + 1 >= $2 THEN 'dead' ELSE 'pending' END,
	next_at = clock_timestamp() + f.after_ms * interval '1 millisecond'
FROM unnest($1::bigint[], $3::text[], $4::bool[], $5::bigint[]) AS f(id, err, final, after_ms)
WHERE o.id = f.id`
	// postpone makes rows due later without an attempt: a failed probe's.
	postpone = `UPDATE idem_outbox o SET next_at = clock_timestamp() + f.ms * interval '1 millisecond'
FROM unnest($1::bigint[], $2::bigint[]) AS f(id, ms) WHERE o.id = f.id`
)

func (r *Relay) mark(ctx context.Context, tx pgx.Tx, rows []*row, results []result) error {
	var marks []rowMark
	for i, res := range results {
		switch {
		case res.sent:
			marks = append(marks, rowMark{id: rows[i].id, sent: true})
		case res.skipped && res.postpone > 0:
			marks = append(marks, rowMark{id: rows[i].id, postpone: max(res.postpone.Milliseconds(), 1)})
		case res.skipped:
		default:
			marks = append(marks, rowMark{id: rows[i].id, err: storable(res.err.Error(), 500), final: res.final,
				after: r.backoff(rows[i].attempts+1, res.after).Milliseconds()})
		}
	}
	if len(marks) == 0 {
		return nil
	}
	err := r.markAll(ctx, tx, marks)
	var pe *pgconn.PgError
	if err == nil || !errors.As(err, &pe) {
		return err
	}
	// The database refused one of the marks: mark the rows one by one, so
	// that one row's bad mark never rolls back its neighbours' (and never
	// has the pass publish them all again).
	r.log.Warn("marking a pass's rows failed; marking them one at a time", "err", err)
	for _, m := range marks {
		err := r.markAll(ctx, tx, []rowMark{m})
		if errors.As(err, &pe) && !m.sent {
			m.err = "the error could not be stored (" + pe.Code + "); see the relay's log"
			r.log.Error("outbox row's error could not be stored", "row", m.id, "err", err)
			err = r.markAll(ctx, tx, []rowMark{m})
		}
		if errors.As(err, &pe) {
			r.log.Error("outbox row could not be marked; it stays as it was", "row", m.id, "err", err)
			continue
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// rowMark is how mark records one row: sent, or failed with err.
type rowMark struct {
	id    int64
	sent  bool
	err   string
	final bool
	after int64 // ms
	// postpone, if set: the row was not tried; it is due again in this
	// many ms, its attempts untouched.
	postpone int64
}

// markAll records marks in one round trip, inside a savepoint: if the
// database refuses them, the pass's transaction goes on without them.
func (r *Relay) markAll(ctx context.Context, tx pgx.Tx, marks []rowMark) error {
	var sent, failed, after, later, laterMs []int64
	var errs []string
	var final []bool
	for _, m := range marks {
		if m.sent {
			sent = append(sent, m.id)
			continue
		}
		if m.postpone > 0 {
			later, laterMs = append(later, m.id), append(laterMs, m.postpone)
			continue
		}
		failed, errs, final, after = append(failed, m.id), append(errs, m.err), append(final, m.final), append(after, m.after)
	}
	b := &pgx.Batch{}
	b.Queue(`SAVEPOINT idem_mark`)
	if len(sent) > 0 {
		if r.cfg.Retention > 0 {
			b.Queue(markSent, sent)
		} else {
			b.Queue(deleteSent, sent)
		}
	}
	if len(failed) > 0 {
		b.Queue(markFailed, failed, r.cfg.MaxAttempts, errs, final, after)
	}
	if len(later) > 0 {
		b.Queue(postpone, later, laterMs)
	}
	b.Queue(`RELEASE SAVEPOINT idem_mark`)
	err := tx.SendBatch(ctx, b).Close()
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		if _, rerr := tx.Exec(ctx, `ROLLBACK TO SAVEPOINT idem_mark`); rerr != nil {
			return fmt.Errorf("mark: %w (and rolling back to the savepoint: %w)", err, rerr)
		}
	}
	if err != nil {
		return fmt.Errorf("mark: %w", err)
	}
	return nil
}

// backoff is the wait before attempt n+1: BackoffMin doubled per attempt,
// capped, jittered, and at least what the destination asked for.
func (r *Relay) backoff(attempts int, asked time.Duration) time.Duration {
	d := r.cfg.BackoffMin
	for i := 1; i < attempts && d < r.cfg.BackoffMax; i++ {
		d *= 2
	}
	d = jitter(min(d, r.cfg.BackoffMax))
	return min(max(d, asked), r.cfg.BackoffMax)
}

func (r *Relay) observe(rows []*row, results []result, took time.Duration) {
	for i, res := range results {
		w := rows[i]
		switch {
		case res.sent:
			r.cfg.Metrics.sent(w.destination, w.age+took)
		case res.skipped:
		case res.final || w.attempts+1 >= r.cfg.MaxAttempts:
			r.cfg.Metrics.failed(w.destination, true)
			r.log.Error("outbox message dead", "message_id", w.messageID(), "event_id", w.eventID, "destination", w.destination,
				"attempts", w.attempts+1, "err", res.err)
		default:
			r.cfg.Metrics.failed(w.destination, false)
			r.log.Warn("outbox publish failed; will retry", "message_id", w.messageID(), "destination", w.destination,
				"attempts", w.attempts+1, "err", res.err)
		}
	}
}

// jitter returns d less up to a fifth, at random.
func jitter(d time.Duration) time.Duration {
	if d <= 0 {
		return d
	}
	return d - time.Duration(rand.Int64N(int64(d)/5+1))
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// storable returns s cut to at most n bytes (and an ellipsis) as text
// Postgres takes: valid UTF-8 without NUL bytes.
func storable(s string, n int) string {
	cut := len(s) > n
	if cut {
		s = s[:n]
	}
	s = strings.ToValidUTF8(strings.ReplaceAll(s, "\x00", ""), "")
	if cut {
		s += "…"
	}
	return s
}
