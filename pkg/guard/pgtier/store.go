package pgtier

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/pkg/guard"
)

// Store is the PostgreSQL tier. It is safe for concurrent use.
type Store struct {
	pool *pgxpool.Pool
	// untimedAt is when this Store last recorded an untimed claim (Unix
	// nanoseconds).
	untimedAt atomic.Int64
}

var _ guard.Store = (*Store)(nil)

// New returns a Store over pool. The pool's search_path must reach the
// idem_processed table created by the migrations.
func New(pool *pgxpool.Pool) *Store { return &Store{pool: pool} }

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
// The shared advisory lock (horizonLock) is held until the transaction
// ends. Prune takes the same lock exclusively after it records a new cut and
// before it deletes a row, so that no claim that read the old horizon is
// still running when its rows go: every claim made after a cut is checked
// against that cut. It is a lock-manager entry, not a row lock: nothing is
// written.
const beginQuery = `BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL synchronous_commit = on; SET LOCAL plan_cache_mode = force_generic_plan; ` +
	`SELECT pg_advisory_xact_lock_shared(` + horizonLockKey + `)`

// horizonLockKey is the two-key advisory lock of the replay horizon: 'idem'
// as a 32-bit integer, and the schema that holds idem's tables (the first of
// the search_path), so that services in two schemas of one database do not
// wait for each other. Two keys, so it can never meet a one-key lock of the
// migrations.
const horizonLockKey = `1768187245, hashtext(current_schema())`

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
const claim = `WITH c AS (
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
)
SELECT event_id, NULL::bytea, true, 0 FROM ins
UNION ALL
SELECT c.id, (SELECT p.payload_hash FROM idem_processed p WHERE p.scope = $1 AND p.event_id = c.id), false, coalesce(c.refused, 0)
FROM c WHERE c.id NOT IN (SELECT event_id FROM ins)`

// refusals maps the claim statement's refusal codes to results.
var refusals = [...]guard.ClaimResult{1: guard.ClaimExpired, 2: guard.ClaimFuture, 3: guard.ClaimUntimed}

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
// claim costs a second.
func (s *Store) Claim(ctx context.Context, tx pgx.Tx, scope string, events []guard.Event) ([]guard.ClaimResult, error) {
	ids := make([]string, len(events))
	hashes := make([][]byte, len(events))
	times := make([]pgtype.Timestamptz, len(events))
	for i, ev := range events {
		ids[i], hashes[i] = ev.ID, ev.Hash
		times[i] = pgtype.Timestamptz{Time: ev.Time, Valid: !ev.Time.IsZero()}
	}
	rows, err := tx.Query(ctx, claim, scope, ids, hashes, times)
	if err != nil {
		return nil, fmt.Errorf("claim dedup rows: %w", err)
	}
	inserted := map[string]bool{}
	stored := map[string][]byte{}
	refused := map[string]guard.ClaimResult{}
	var id string
	var hash []byte
	var ins bool
	var code int
	_, err = pgx.ForEachRow(rows, []any{&id, &hash, &ins, &code}, func() error {
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
		return nil, fmt.Errorf("claim dedup rows: %w", err)
	}
	out := make([]guard.ClaimResult, len(events))
	untimed := false
	for i, ev := range events {
		if inserted[ev.ID] {
			// The first copy is ours; a later copy is held to its hash.
			out[i] = guard.ClaimInserted
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
			return nil, err
		}
	}
	return out, s.resolveExisting(ctx, tx, scope, events, out)
}

// untimedEvery is how often one Store records that it claimed an untimed
// event (idem_horizon.untimed_claimed_at).
const untimedEvery = time.Minute

// recordUntimed notes in tx that an untimed event was claimed, at most once
// every untimedEvery per Store, so that prune learns that such events still
// arrive. It commits or rolls back with the claim.
func (s *Store) recordUntimed(ctx context.Context, tx pgx.Tx) error {
	now := time.Now().UnixNano()
	last := s.untimedAt.Load()
	if now-last < int64(untimedEvery) || !s.untimedAt.CompareAndSwap(last, now) {
		return nil
	}
	if _, err := tx.Exec(ctx, `UPDATE idem_horizon SET untimed_claimed_at = now()`); err != nil {
		s.untimedAt.Store(last)
		return fmt.Errorf("record untimed claim: %w", err)
	}
	return nil
}

func compare(stored, hash []byte) guard.ClaimResult {
	if bytes.Equal(stored, hash) {
		return guard.ClaimDuplicate
	}
	return guard.ClaimConflict
}

// resolveExisting fills in the results of events whose row already existed.
// It runs as a new statement, so under READ COMMITTED it sees the row that a
// concurrent transaction committed while our INSERT waited on it.
func (s *Store) resolveExisting(ctx context.Context, tx pgx.Tx, scope string, events []guard.Event, out []guard.ClaimResult) error {
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

// Horizon is the database's record of the replay horizon (idem_horizon).
type Horizon struct {
	// Retention is the longest retention any consumer has enforced.
	Retention time.Duration
	// ClockSkew is the largest clock skew any consumer has allowed.
	ClockSkew time.Duration
	// PrunedThrough is the latest cut a prune made: rows processed before
	// it are gone. Zero if nothing was pruned.
	PrunedThrough time.Time
}

// EnforceRetention records that a consumer refuses events older than
// retention, allowing clock skew, and returns the record. The record keeps the
// greatest of each ever recorded, so Prune can never cut below what some
// consumer enforces. Claim enforces the recorded values, so the horizon
// recorded is the horizon enforced; a consumer may also refuse events older
// than the returned PrunedThrough + ClockSkew early, before it claims them.
func (s *Store) EnforceRetention(ctx context.Context, retention, skew time.Duration) (Horizon, error) {
	if retention <= 0 || skew <= 0 {
		return Horizon{}, fmt.Errorf("enforce retention: want a positive retention and clock skew, got %s and %s (a zero skew would refuse every event stamped a moment ahead of the database's clock)", retention, skew)
	}
	var h Horizon
	var pruned *time.Time
	err := s.pool.QueryRow(ctx, `INSERT INTO idem_horizon (retention, clock_skew) VALUES ($1, $2)
		ON CONFLICT (id) DO UPDATE SET
			retention  = GREATEST(idem_horizon.retention, EXCLUDED.retention),
			clock_skew = GREATEST(idem_horizon.clock_skew, EXCLUDED.clock_skew),
			updated_at = now()
		RETURNING retention, clock_skew, pruned_through`, retention, skew).Scan(&h.Retention, &h.ClockSkew, &pruned)
	if err != nil {
		return Horizon{}, fmt.Errorf("enforce retention: %w", err)
	}
	if pruned != nil {
		h.PrunedThrough = *pruned
	}
	return h, nil
}

// ErrWrongShard is returned by CheckShard when the database was recorded as
// another shard, or as a shard of another number of shards.
var ErrWrongShard = errors.New("database holds another shard")

// CheckShard records that this database is shard shard of shards, or, if a
// place was recorded before, returns ErrWrongShard unless it is the same.
// Call it at start: a reordered or resized shard list would route keys to
// databases that do not hold their dedup history.
func (s *Store) CheckShard(ctx context.Context, shard, shards int) error {
	if shard < 0 || shard >= shards {
		return fmt.Errorf("check shard: want 0 <= shard < shards, got %d of %d", shard, shards)
	}
	// DO UPDATE, not DO NOTHING: the statement then waits for a first
	// recorder that has not committed yet and returns the row it wrote. (A
	// SELECT beside DO NOTHING reads the statement's snapshot, taken before
	// that commit, and finds no row.) The update keeps the stored values.
	var was, of int
	err := s.pool.QueryRow(ctx, `INSERT INTO idem_shard (shard, shards) VALUES ($1, $2)
		ON CONFLICT (id) DO UPDATE SET shard = idem_shard.shard
		RETURNING shard, shards`, shard, shards).Scan(&was, &of)
	if err != nil {
		return fmt.Errorf("check shard: %w", err)
	}
	if was != shard || of != shards {
		return fmt.Errorf("%w: it was set up as shard %d of %d, and is now listed as shard %d of %d", ErrWrongShard, was, of, shard, shards)
	}
	return nil
}

// ErrRetentionBelowConsumers is returned by Prune when asked to cut below the
// retention some consumer enforces.
var ErrRetentionBelowConsumers = errors.New("retention is shorter than consumers enforce")

// ErrUntimedStillArriving is returned by Prune before the first cut while
// consumers claimed events that carry no time within the retention window:
// from the first cut on, such events are refused (guard.ErrUntimedEvent).
var ErrUntimedStillArriving = errors.New("events without a time are still being claimed")

// PruneConfig says how Prune cuts.
type PruneConfig struct {
	// Retention is how long dedup rows are kept. It may not be shorter than
	// the retention consumers recorded. Required.
	Retention time.Duration
	// ClockSkew is the allowance added to Retention, used only if no
	// consumer recorded one yet (the recorded one wins). Required.
	ClockSkew time.Duration
	// Batch is how many rows one DELETE removes. Required.
	Batch int
	// CutUntimed makes the first cut even though events without a time
	// were claimed within the retention window. From then on, such an
	// event whose row is gone is refused.
	CutUntimed bool
}

// Prune deletes dedup rows processed more than Retention + the recorded
// clock skew ago, and returns how many it deleted and where it cut. It
// refuses a retention shorter than the one recorded by EnforceRetention
// (ErrRetentionBelowConsumers): a consumer could then accept a redelivery
// whose row is gone, and apply it twice. It refuses the first cut while
// untimed events still arrive, unless CutUntimed (ErrUntimedStillArriving).
//
// It records the cut before deleting anything, then waits until every guard
// transaction begun before the record has ended (see Begin): a claim either
// ran while the rows were still there, or is checked against the new cut.
func (s *Store) Prune(ctx context.Context, cfg PruneConfig) (int64, time.Time, error) {
	retention, skew, batch := cfg.Retention, cfg.ClockSkew, cfg.Batch
	if retention <= 0 || skew <= 0 || batch < 1 {
		return 0, time.Time{}, fmt.Errorf("prune: want a positive retention, clock skew and batch, got %s, %s and %d", retention, skew, batch)
	}
	var cutoff time.Time
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		var recorded time.Duration
		var pruned, untimed *time.Time
		err := tx.QueryRow(ctx, `SELECT retention, clock_skew, pruned_through, untimed_claimed_at FROM idem_horizon FOR UPDATE`).
			Scan(&recorded, &skew, &pruned, &untimed)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			// No consumer has started on this database: record ours, so
			// that they start from it.
			recorded = retention
		case err != nil:
			return fmt.Errorf("prune: read idem_horizon: %w", err)
		case retention < recorded:
			return fmt.Errorf("prune: %w: asked for %s, consumers enforce %s (set postgres.retention to at least that, or lower the consumers' first and run prune --reset-horizon)",
				ErrRetentionBelowConsumers, retention, recorded)
		case pruned == nil && untimed != nil && time.Since(*untimed) < retention+skew && !cfg.CutUntimed:
			return fmt.Errorf("prune: %w: the last at %s. After the first cut, an event without a time (no occurredAt, no AMQP timestamp) is refused as missing_time, since it could be a replay of a pruned event. Make the producers stamp their events, or cut anyway with --cut-untimed",
				ErrUntimedStillArriving, untimed.UTC().Format(time.RFC3339))
		}
		return tx.QueryRow(ctx, `INSERT INTO idem_horizon (retention, clock_skew, pruned_through)
			VALUES ($1::interval, $2::interval, now() - ($1::interval + $2::interval))
			ON CONFLICT (id) DO UPDATE SET
				pruned_through = GREATEST(idem_horizon.pruned_through, EXCLUDED.pruned_through),
				updated_at = now()
			RETURNING now() - ($1::interval + $2::interval)`, retention, skew).Scan(&cutoff)
	})
	if err != nil {
		return 0, time.Time{}, err
	}
	// The barrier: the exclusive lock is granted once every guard
	// transaction that holds the shared one (begun before the cut was
	// recorded) has ended.
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(`+horizonLockKey+`)`)
		return err
	})
	if err != nil {
		return 0, cutoff, fmt.Errorf("prune: wait for claims begun before the cut: %w", err)
	}
	var total int64
	for {
		tag, err := s.pool.Exec(ctx, `DELETE FROM idem_processed WHERE ctid = ANY (ARRAY(
			SELECT ctid FROM idem_processed WHERE processed_at < $1 LIMIT $2))`, cutoff, batch)
		if err != nil {
			return total, cutoff, fmt.Errorf("prune: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batch) {
			return total, cutoff, nil
		}
	}
}

// ResetHorizon sets the recorded retention to retention, for an operator who
// lowered every consumer's retention: EnforceRetention alone only ever
// raises it. The recorded clock skew is raised to skew, never lowered: the
// rows already kept were claimed under the larger one, and a cut is checked
// against it.
func (s *Store) ResetHorizon(ctx context.Context, retention, skew time.Duration) error {
	if retention <= 0 || skew <= 0 {
		return fmt.Errorf("reset horizon: want a positive retention and clock skew, got %s and %s", retention, skew)
	}
	_, err := s.pool.Exec(ctx, `INSERT INTO idem_horizon (retention, clock_skew) VALUES ($1, $2)
		ON CONFLICT (id) DO UPDATE SET retention = EXCLUDED.retention,
			clock_skew = GREATEST(idem_horizon.clock_skew, EXCLUDED.clock_skew), updated_at = now()`,
		retention, skew)
	if err != nil {
		return fmt.Errorf("reset horizon: %w", err)
	}
	return nil
}
