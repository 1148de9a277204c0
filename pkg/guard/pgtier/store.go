package pgtier

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/internal/horizon"
	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/guard"
)

// Store is the PostgreSQL tier. It is safe for concurrent use.
type Store struct {
	pool    *pgxpool.Pool
	untimed untimedRecord
	history string   // the history query
	skip    []string // Options.HistoryWithout
	// noMarkers: no done marker is written or trusted for these rows
	// (Options.NoMarkers), and claims do not read the history.
	noMarkers bool
	// claim is the claim statement, with the system identifier it keeps
	// (see historyCTE), replaced when a claim reads another.
	claim atomic.Pointer[claimStmt]
	// unkept: a read of the history found another identifier under the
	// kept start time, and claims read the control file from then on.
	unkept atomic.Bool
	// keeping orders keep (a claim that read the control file, rare) and
	// check (a read of the history): without it a keep that saw unkept
	// false could store its statement after check's.
	keeping sync.Mutex
}

// claimStmt is a claim statement and the identifier it keeps (nil: none).
type claimStmt struct {
	sql string
	key *sysKey
}

var _ guard.Store = (*Store)(nil)

// New returns a Store over pool. The pool's search_path must reach the
// idem_processed table created by the migrations. Behind a transaction-mode
// pooler (PgBouncer pool_mode=transaction, RDS Proxy, Supavisor) its
// connections must not prepare named statements (pgx's cache_describe,
// exec or simple_protocol mode): idem.New and the idem commands check that
// at start, New does not.
func New(pool *pgxpool.Pool) *Store {
	s, _ := NewWith(pool, Options{}) // no part to refuse
	return s
}

// Options tune a Store made by NewWith.
type Options struct {
	// HistoryWithout leaves parts of the database's history out (their
	// names are HistoryParts' keys), for a managed service that refuses
	// their functions. A weaker guarantee, taken knowingly: a done marker
	// in Redis is no longer checked against what each part tells (see
	// HistoryParts), so an event the database lost that way, re-sent while
	// Redis still holds its marker, is dropped as a duplicate. Leave it
	// empty wherever the functions can be granted.
	HistoryWithout []string
	// NoMarkers says that no done marker is ever written or trusted for
	// this Store's rows: the guard it backs has no fast tier (Redis
	// disabled). A claim then does not read the database's history, which
	// only labels and confirms markers (History still reads it), and its
	// claims report the empty history, which confirms no marker: beside a
	// fast tier, the guard writes no marker and trusts none for them.
	NoMarkers bool
}

// NewWith is New with o; it refuses an unknown history part.
func NewWith(pool *pgxpool.Pool, o Options) (*Store, error) {
	if err := checkParts(o.HistoryWithout); err != nil {
		return nil, err
	}
	skip := slices.Clone(o.HistoryWithout)
	s := &Store{pool: pool, history: `SELECT ` + historyOf(skip, sysidPart, startPart), skip: skip, noMarkers: o.NoMarkers}
	if keeps(skip) {
		s.history += `, ` + sysidPart + `, ` + startPart
	}
	hist := historyCTE(skip, nil)
	if o.NoMarkers {
		hist = noHistory
	}
	s.claim.Store(&claimStmt{sql: claimWith(hist)})
	return s, nil
}

// noHistory is the claim's hist in a Store without markers
// (Options.NoMarkers): the guard takes a claim's empty history as none
// reported.
const noHistory = `SELECT ''::text AS history, NULL::text AS sysid_read, NULL::text AS start_read`

// keep makes the claim statement take the system identifier from k, which a
// claim read, while the server's start time is k's, unless it does already.
func (s *Store) keep(k sysKey) {
	if s.noMarkers || !keeps(s.skip) {
		return
	}
	s.keeping.Lock()
	defer s.keeping.Unlock()
	cur := s.claim.Load()
	if s.unkept.Load() || (cur.key != nil && *cur.key == k) {
		return
	}
	s.claim.Store(&claimStmt{sql: claimWith(historyCTE(s.skip, &k)), key: &k})
}

// check compares what a read of the control file found, k, with the
// identifier kept. Another identifier under the kept start time means the
// start time does not tell servers apart (a managed service that reports
// its own), so the Store stops keeping one for good: every claim reads the
// control file from then on. The claims that took the kept identifier
// reported a history that this read's differs from: the guard logs the
// change, and a marker written with that history is confirmed by no read
// or claim from then on.
func (s *Store) check(k sysKey) {
	s.keeping.Lock()
	defer s.keeping.Unlock()
	cur := s.claim.Load()
	if cur.key == nil || cur.key.start != k.start || cur.key.sysid == k.sysid {
		return
	}
	s.unkept.Store(true)
	s.claim.Store(&claimStmt{sql: claimWith(historyCTE(s.skip, nil))})
}

// beginQuery starts the guard's transactions. synchronous_commit is pinned
// on: with it off (in the server's config, the role's, the database's or
// the connection string's) a COMMIT returns before it is durable, and an
// event acked after it could be lost in a crash. Every statement goes in one
// round trip (simple protocol).
//
// plan_cache_mode is pinned to generic plans: the claim's plan does not
// depend on its arguments, and a custom plan would be made again for every
// call. This holds for the handler's statements in the same transaction too.
//
// The shared advisory lock (horizon.LockKey) is held until the transaction
// ends. Prune takes the same lock exclusively after it records a new cut and
// before it deletes a row, so that no claim that read the old horizon is
// still running when its rows go: every claim made after a cut is checked
// against that cut. It is a lock-manager entry, not a row lock: nothing is
// written.
const beginQuery = `BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL synchronous_commit = on; SET LOCAL plan_cache_mode = force_generic_plan; ` +
	`SELECT pg_advisory_xact_lock_shared(` + horizon.LockKey + `)`

// Begin starts a READ COMMITTED transaction whose COMMIT is durable
// (synchronous_commit on, whatever the server's setting), whose prepared
// statements use generic plans, and which a prune waits for before it
// deletes rows.
func (s *Store) Begin(ctx context.Context) (pgx.Tx, error) {
	return s.pool.BeginTx(ctx, pgx.TxOptions{BeginQuery: beginQuery})
}

// claim inserts the dedup rows and, in the same round trip, reads the hash of
// record of each row that already existed. Rows are inserted in the order
// given (the guard sorts them), so two claims lock shared keys in one order.
// Each existing row is looked up by its whole primary key, one probe per ID
// not just inserted: whatever the planner believes of the table's size (a new
// table has no statistics, and the generic plan made then is kept), an
// equality on every column of a unique key is an index probe, never a scan
// of a whole scope. A batch of new events costs no probe at all. The
// statement snapshot cannot see a row that a concurrent transaction committed
// while the INSERT waited on it: such an ID comes back with a NULL hash, and
// resolveExisting looks it up again in a new statement.
//
// The replay horizon is checked here, where the row is claimed, against the
// values idem_horizon records (the ones prune cuts by) and the database's
// clock, however long the delivery was held before: an event is refused,
// and no row inserted, when it is older than the recorded retention or than
// the last cut plus the clock skew (1, ClaimExpired), further ahead than the
// clock skew (2, ClaimFuture), or untimed after a cut (3, ClaimUntimed). An
// event refused whose row exists is still a duplicate (or a conflict): only
// a missing row is in doubt. With no idem_horizon row nothing was ever
// pruned, and nothing is refused.
//
// Every row also carries the database's history (historyCTE), read once,
// by the same statement: the guard confirms done markers with it, and
// names it in the markers of the events this transaction commits. Where
// the statement read the system identifier from the control file, not
// from what the Store keeps, the rows carry it and the start time it was
// read with, for the Store to keep (keep).
//
// A claim that inserts nothing writes a WAL message (wal), in the same
// statement, unless everything it can have found is already as durable as
// the message would make it: see Claim. The CTE runs once, when the rows of
// events not inserted are read, which a claim that inserted nothing always
// has; its CASE reads the WAL positions only once ins has run to its end
// (waits on concurrent inserters included).
func claimWith(hist string) string {
	return `WITH hist AS (` + hist + `), c AS (
	SELECT u.id, u.hash, u.n, CASE
		WHEN u.at IS NULL THEN CASE WHEN h.pruned_through IS NOT NULL THEN 3 END
		WHEN u.at > now() + h.clock_skew THEN 2
		WHEN u.at <= statement_timestamp() - h.retention OR u.at < h.pruned_through + h.clock_skew THEN 1
	END AS refused
	FROM unnest($2::text[], $3::bytea[], $4::timestamptz[]) WITH ORDINALITY AS u(id, hash, at, n)
	LEFT JOIN idem_horizon h ON true
), ins AS (
	INSERT INTO idem_processed (scope, event_id, payload_hash)
	SELECT $1, id, hash FROM c WHERE refused IS NULL ORDER BY n
	ON CONFLICT DO NOTHING
	RETURNING event_id
), wal AS (
	SELECT pg_logical_emit_message(true, 'idem', '') AS lsn WHERE CASE
		WHEN EXISTS (SELECT 1 FROM ins) THEN false
		ELSE NOT (` + durable + `)
	END
)
SELECT event_id, NULL::bytea, true, 0, hist.history, false, hist.sysid_read, hist.start_read FROM ins, hist
UNION ALL
SELECT c.id, (SELECT p.payload_hash FROM idem_processed p WHERE p.scope = $1 AND p.event_id = c.id), false, coalesce(c.refused, 0), hist.history,
	EXISTS (SELECT 1 FROM wal), hist.sysid_read, hist.start_read
FROM c, hist WHERE c.id NOT IN (SELECT event_id FROM ins)`
}

// claim is the claim statement with every part of the history read.
var claim = claimWith(historyCTE(nil, nil))

// refusals maps the claim statement's refusal codes to results.
var refusals = [...]tier.ClaimResult{1: tier.ClaimExpired, 2: tier.ClaimFuture, 3: tier.ClaimUntimed}

// lookup reads the hash of record of each ID, by its whole primary key;
// NULL where there is no row.
const lookup = `SELECT u.id, (SELECT p.payload_hash FROM idem_processed p WHERE p.scope = $1 AND p.event_id = u.id)
FROM unnest($2::text[]) AS u(id)`

// Claim inserts a dedup row for each event inside tx, in the order given. An
// event whose row already exists is ClaimDuplicate if the stored payload hash
// matches and ClaimConflict if it does not; a second copy of an ID in events
// is compared with the first. An event with no row that is outside the
// recorded replay horizon is refused (ClaimExpired, ClaimFuture,
// ClaimUntimed) and gets no row. New events and duplicates alike cost one
// statement; only a row committed by a concurrent transaction during the
// claim costs a second. The same statement reads the database's history
// (see History), which Claim returns: the rows it inserts commit in it.
// With no events it returns no history.
func (s *Store) Claim(ctx context.Context, tx pgx.Tx, scope string, events []guard.Event) ([]tier.ClaimResult, tier.History, error) {
	ids := make([]string, len(events))
	hashes := make([][]byte, len(events))
	times := make([]pgtype.Timestamptz, len(events))
	for i, ev := range events {
		ids[i], hashes[i] = ev.ID, ev.Hash
		times[i] = pgtype.Timestamptz{Time: ev.Time, Valid: !ev.Time.IsZero()}
	}
	rows, err := tx.Query(ctx, s.claim.Load().sql, scope, ids, hashes, times)
	if err != nil {
		return nil, "", fmt.Errorf("claim dedup rows: %w", err)
	}
	inserted := map[string]bool{}
	stored := map[string][]byte{}
	refused := map[string]tier.ClaimResult{}
	var id string
	var hash []byte
	var ins bool
	var code int
	var history string
	var walled bool          // the WAL message was written (a claim that inserted nothing)
	var sysid, start *string // read from the control file, not taken from what the Store keeps
	_, err = pgx.ForEachRow(rows, []any{&id, &hash, &ins, &code, &history, &walled, &sysid, &start}, func() error {
		switch {
		case ins:
			inserted[id] = true
		case hash != nil:
			stored[id] = bytes.Clone(hash)
		case code > 0 && code < len(refusals):
			refused[id] = refusals[code]
		}
		return nil
	})
	if err != nil {
		return nil, "", fmt.Errorf("claim dedup rows: %w", err)
	}
	if sysid != nil && start != nil {
		s.keep(sysKey{start: *start, sysid: *sysid})
	}
	out := make([]tier.ClaimResult, len(events))
	untimed := false
	for i, ev := range events {
		if inserted[ev.ID] {
			// The first copy is ours; a later copy is held to its hash.
			out[i] = tier.ClaimInserted
			untimed = untimed || ev.Time.IsZero()
			delete(inserted, ev.ID)
			stored[ev.ID] = ev.Hash
			continue
		}
		if h, ok := stored[ev.ID]; ok {
			out[i] = compare(h, ev.Hash)
			continue
		}
		out[i] = refused[ev.ID] // zero (not known yet) unless refused
	}
	if untimed {
		if err := s.recordUntimed(ctx, tx); err != nil {
			return nil, "", err
		}
	}
	if err := s.resolveExisting(ctx, tx, scope, events, out); err != nil {
		return nil, "", err
	}
	return out, tier.History(history), nil
}

// A claim that inserts nothing but finds rows writes a WAL message (the
// claim statement's wal), so that its COMMIT waits, as one that inserts
// does, for what synchronous_commit asks: a synchronous standby's flush of
// everything before it, the rows found included. A row found may be a
// commit the server kept after its client gave up waiting for the standby
// (a cancelled wait is not a rollback): acked as a duplicate on its word
// alone, the event would be lost with it on failover. The message is the
// cheapest write that gives a transaction an ID and a commit record, and
// nothing decodes it; riding in the claim, it costs no round trip.
//
// The message is left out when it could add nothing: no synchronous
// standby is configured (synchronous_standby_names is empty, so a COMMIT
// waits for nothing beyond the local flush) and the local WAL is flushed
// through its insert position (durable). Every commit the claim can have
// found was inserted in the WAL before it became visible, and so before
// that position, read once the claim's insert has run to its end (a row
// whose inserter the claim waited for included): each is on disk already.
// A stream of duplicates with Redis off, or Redis's markers untrusted, then
// commits nothing, instead of a WAL flush per transaction, which halved the
// rate of found-only transactions. With a synchronous standby, or with
// commits not yet flushed (synchronous_commit off in some session), the
// message is written as before.

// durable: nothing a statement can see needs a WAL message to be durable
// where a COMMIT would wait for it. pg_current_wal_insert_lsn and
// pg_current_wal_flush_lsn are volatile: read when the CASE reaches them.
const durable = `current_setting('synchronous_standby_names') = '' AND pg_current_wal_flush_lsn() >= pg_current_wal_insert_lsn()`

// untimedEvery is how often one Store records that it claimed an untimed
// event (idem_horizon.untimed_claimed_at).
const untimedEvery = time.Minute

// untimedRecord is what a Store knows of its last write of
// untimed_claimed_at. The write commits or rolls back with a claim's
// transaction, which the Store does not see end: until a later transaction
// finds the value in place, the write is not known to have committed, and
// the next untimed claim writes it again if it did not. Otherwise a first
// attempt that rolled back would leave the column unrecorded for a minute,
// and prune could make its first cut while untimed events arrive.
type untimedRecord struct {
	mu    sync.Mutex
	busy  bool      // a claim is writing or checking
	wrote time.Time // the value the last write set (the database's now()); zero: none
	known bool      // that write (or a later one) is known to have committed
	at    time.Time // when it was written, by this process's clock
}

// recordIfMissing sets untimed_claimed_at to now() in the claim's
// transaction unless it already holds $1 or later: with $1 the value this
// Store last wrote, a no-op once that write committed (a transaction still
// writing it is waited for); with $1 infinity, a fresh write.
const recordIfMissing = `UPDATE idem_horizon SET untimed_claimed_at = now()
WHERE untimed_claimed_at IS NULL OR untimed_claimed_at < $1 RETURNING untimed_claimed_at`

// recordUntimed notes in tx that an untimed event was claimed, so that
// prune learns that such events still arrive: once every untimedEvery per
// Store, plus until that write is known to have committed (untimedRecord).
// It commits or rolls back with the claim.
func (s *Store) recordUntimed(ctx context.Context, tx pgx.Tx) error {
	r := &s.untimed
	r.mu.Lock()
	if r.busy || (r.known && time.Since(r.at) < untimedEvery) {
		r.mu.Unlock()
		return nil
	}
	r.busy = true
	check := !r.known && !r.wrote.IsZero()
	since := pgtype.Timestamptz{InfinityModifier: pgtype.Infinity, Valid: true}
	if check {
		since = pgtype.Timestamptz{Time: r.wrote, Valid: true}
	}
	r.mu.Unlock()

	var wrote time.Time
	err := tx.QueryRow(ctx, recordIfMissing, since).Scan(&wrote)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.busy = false
	switch {
	case errors.Is(err, pgx.ErrNoRows) && check:
		r.known = true // the last write committed, or a later one did
	case errors.Is(err, pgx.ErrNoRows):
		// No idem_horizon row: no consumer recorded a horizon yet, and
		// nothing to write; try again in untimedEvery.
		r.known, r.at = true, time.Now()
	case err != nil:
		return fmt.Errorf("record untimed claim: %w", err)
	default:
		r.wrote, r.known, r.at = wrote, false, time.Now()
	}
	return nil
}

func compare(stored, hash []byte) tier.ClaimResult {
	if bytes.Equal(stored, hash) {
		return tier.ClaimDuplicate
	}
	return tier.ClaimConflict
}

// resolveExisting fills in the results of events whose row already existed.
// It runs as a new statement, so under READ COMMITTED it sees the row that a
// concurrent transaction committed while our INSERT waited on it.
func (s *Store) resolveExisting(ctx context.Context, tx pgx.Tx, scope string, events []guard.Event, out []tier.ClaimResult) error {
	var ids []string
	for i, ev := range events {
		if out[i] == 0 {
			ids = append(ids, ev.ID)
		}
	}
	if len(ids) == 0 {
		return nil
	}
	rows, err := tx.Query(ctx, lookup, scope, ids)
	if err != nil {
		return fmt.Errorf("look up dedup rows: %w", err)
	}
	stored := map[string][]byte{}
	var id string
	var hash []byte
	_, err = pgx.ForEachRow(rows, []any{&id, &hash}, func() error {
		if hash != nil {
			stored[id] = bytes.Clone(hash)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("look up dedup rows: %w", err)
	}
	for i, ev := range events {
		if out[i] != 0 {
			continue
		}
		h, ok := stored[ev.ID]
		if !ok {
			// The conflicting row vanished between the two statements: only
			// a prune of an expired row can do that, so the event is older
			// than the retention window and its history is gone.
			return fmt.Errorf("claim %s: %w", ev.ID, guard.ErrBeyondRetention)
		}
		out[i] = compare(h, ev.Hash)
	}
	return nil
}

// History returns the current history of the database the pool reaches,
// in one small query: a guard reads it after it read done markers, to
// confirm them, when it has no claim to read it in. Claim returns the same
// value, read in its own statement.
func (s *Store) History(ctx context.Context) (tier.History, error) {
	var h string
	var k sysKey
	dest := []any{&h}
	if keeps(s.skip) {
		dest = append(dest, &k.sysid, &k.start)
	}
	if err := s.pool.QueryRow(ctx, s.history).Scan(dest...); err != nil {
		return "", fmt.Errorf("read database history: %w", err)
	}
	if keeps(s.skip) && !s.noMarkers {
		s.check(k)
	}
	return tier.History(h), nil
}
