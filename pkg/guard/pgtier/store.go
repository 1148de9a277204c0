package pgtier

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/pkg/guard"
)

// Store is the PostgreSQL tier. It is safe for concurrent use.
type Store struct {
	pool *pgxpool.Pool
}

var _ guard.Store = (*Store)(nil)

// New returns a Store over pool. The pool's search_path must reach the
// idem_processed table created by the migrations.
func New(pool *pgxpool.Pool) *Store { return &Store{pool: pool} }

// beginQuery starts the guard's transactions. synchronous_commit is pinned
// on: with it off (in the server's config, the role's, the database's or
// the connection string's) a COMMIT returns before it is durable, and an
// event acked after it could be lost in a crash. Both statements go in one
// round trip (simple protocol).
//
// plan_cache_mode is pinned to generic plans: the claim's plan does not
// depend on its arguments, and a custom plan would be made again for every
// call. This holds for the handler's statements in the same transaction too.
const beginQuery = `BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL synchronous_commit = on; SET LOCAL plan_cache_mode = force_generic_plan`

// Begin starts a READ COMMITTED transaction whose COMMIT is durable
// (synchronous_commit on, whatever the server's setting) and whose prepared
// statements use generic plans.
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
const claim = `WITH ins AS (
	INSERT INTO idem_processed (scope, event_id, payload_hash)
	SELECT $1, id, hash FROM unnest($2::text[], $3::bytea[]) WITH ORDINALITY AS t(id, hash, n) ORDER BY n
	ON CONFLICT DO NOTHING
	RETURNING event_id
)
SELECT event_id, NULL::bytea, true FROM ins
UNION ALL
SELECT u.id, (SELECT p.payload_hash FROM idem_processed p WHERE p.scope = $1 AND p.event_id = u.id), false
FROM unnest($2::text[]) AS u(id) WHERE u.id NOT IN (SELECT event_id FROM ins)`

// lookup reads the hash of record of each ID, by its whole primary key;
// NULL where there is no row.
const lookup = `SELECT u.id, (SELECT p.payload_hash FROM idem_processed p WHERE p.scope = $1 AND p.event_id = u.id)
FROM unnest($2::text[]) AS u(id)`

// Claim inserts a dedup row for each event inside tx, in the order given. An
// event whose row already exists is ClaimDuplicate if the stored payload hash
// matches and ClaimConflict if it does not; a second copy of an ID in events
// is compared with the first. New events and duplicates alike cost one
// statement; only a row committed by a concurrent transaction during the
// claim costs a second.
func (s *Store) Claim(ctx context.Context, tx pgx.Tx, scope string, events []guard.Event) ([]guard.ClaimResult, error) {
	ids := make([]string, len(events))
	hashes := make([][]byte, len(events))
	for i, ev := range events {
		ids[i], hashes[i] = ev.ID, ev.Hash
	}
	rows, err := tx.Query(ctx, claim, scope, ids, hashes)
	if err != nil {
		return nil, fmt.Errorf("claim dedup rows: %w", err)
	}
	inserted := map[string]bool{}
	stored := map[string][]byte{}
	var id string
	var hash []byte
	var ins bool
	_, err = pgx.ForEachRow(rows, []any{&id, &hash, &ins}, func() error {
		switch {
		case ins:
			inserted[id] = true
		case hash != nil:
			stored[id] = bytes.Clone(hash)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("claim dedup rows: %w", err)
	}
	out := make([]guard.ClaimResult, len(events))
	for i, ev := range events {
		if inserted[ev.ID] {
			// The first copy is ours; a later copy is held to its hash.
			out[i] = guard.ClaimInserted
			delete(inserted, ev.ID)
			stored[ev.ID] = ev.Hash
			continue
		}
		if h, ok := stored[ev.ID]; ok {
			out[i] = compare(h, ev.Hash)
		}
	}
	return out, s.resolveExisting(ctx, tx, scope, events, out)
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
// consumer enforces. The consumer must also refuse events older than the
// returned PrunedThrough + ClockSkew: a prune may have cut there under a
// shorter retention before this one was recorded.
func (s *Store) EnforceRetention(ctx context.Context, retention, skew time.Duration) (Horizon, error) {
	if retention <= 0 || skew < 0 {
		return Horizon{}, fmt.Errorf("enforce retention: want a positive retention and a non-negative skew, got %s and %s", retention, skew)
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

// Prune deletes dedup rows processed more than retention + the recorded
// clock skew ago (skew, if no consumer has recorded one yet), in batches of
// batch rows, and returns how many it deleted and where it cut. It refuses a retention shorter than the one recorded by
// EnforceRetention (ErrRetentionBelowConsumers): a consumer could then accept
// a redelivery whose row is gone, and apply it twice. It records the cut
// before deleting anything, so a consumer that starts meanwhile sees it.
func (s *Store) Prune(ctx context.Context, retention, skew time.Duration, batch int) (int64, time.Time, error) {
	if retention <= 0 || skew < 0 || batch < 1 {
		return 0, time.Time{}, fmt.Errorf("prune: want a positive retention and batch and a non-negative skew, got %s, %d and %s", retention, batch, skew)
	}
	var cutoff time.Time
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		var recorded time.Duration
		err := tx.QueryRow(ctx, `SELECT retention, clock_skew FROM idem_horizon FOR UPDATE`).Scan(&recorded, &skew)
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

// ResetHorizon sets the recorded retention and clock skew to these values,
// for an operator who lowered every consumer's retention: EnforceRetention
// alone only ever raises them.
func (s *Store) ResetHorizon(ctx context.Context, retention, skew time.Duration) error {
	_, err := s.pool.Exec(ctx, `INSERT INTO idem_horizon (retention, clock_skew) VALUES ($1, $2)
		ON CONFLICT (id) DO UPDATE SET retention = EXCLUDED.retention, clock_skew = EXCLUDED.clock_skew, updated_at = now()`,
		retention, skew)
	if err != nil {
		return fmt.Errorf("reset horizon: %w", err)
	}
	return nil
}
