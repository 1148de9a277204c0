// Package horizon keeps the replay horizon an authoritative database
// records (idem_horizon): the retention and clock skew consumers enforce,
// which the claim checks, and where pruning cut. Prune deletes old dedup
// rows without ever cutting below what a consumer enforces.
package horizon

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// LockKey is the advisory lock every guard transaction takes shared at
// BEGIN (pgtier.Store.Begin), so that Prune can tell, after recording a
// cut, which transactions may have read the old horizon: it waits for
// those that hold it then (barrier).
// Its two keys are 'idem' as a 32-bit integer and the schema that holds
// idem's tables (the first of the search_path), so that services in two
// schemas of one database do not wait for each other. Two keys, so it can
// never meet a one-key lock of the migrations.
const LockKey = `1768187245, hashtext(current_schema())`

// lockKeyOIDs is LockKey as pg_locks shows a two-key advisory lock: its
// keys in classid and objid (objsubid 2).
const lockKeyOIDs = `1768187245::oid, hashtext(current_schema())::oid`

// Record is the database's record of the replay horizon (idem_horizon).
type Record struct {
	// Retention is the longest retention any consumer has enforced.
	Retention time.Duration
	// ClockSkew is the largest clock skew any consumer has allowed.
	ClockSkew time.Duration
	// PrunedThrough is the latest cut a prune made: rows processed before
	// it are gone. Zero if nothing was pruned.
	PrunedThrough time.Time
}

// Enforce records that a consumer refuses events older than
// retention, allowing clock skew, and returns the record. The record keeps the
// greatest of each ever recorded, so Prune can never cut below what some
// consumer enforces. Claim enforces the recorded values, so the horizon
// recorded is the horizon enforced; a consumer may also refuse events older
// than the returned PrunedThrough + ClockSkew early, before it claims them.
func Enforce(ctx context.Context, db *pgxpool.Pool, retention, skew time.Duration) (Record, error) {
	if retention <= 0 || skew <= 0 {
		return Record{}, fmt.Errorf("enforce retention: want a positive retention and clock skew, got %s and %s (a zero skew would refuse every event stamped a moment ahead of the database's clock)", retention, skew)
	}
	var h Record
	var pruned *time.Time
	err := db.QueryRow(ctx, `INSERT INTO idem_horizon (retention, clock_skew) VALUES ($1, $2)
		ON CONFLICT (id) DO UPDATE SET
			retention  = GREATEST(idem_horizon.retention, EXCLUDED.retention),
			clock_skew = GREATEST(idem_horizon.clock_skew, EXCLUDED.clock_skew),
			updated_at = now()
		RETURNING retention, clock_skew, pruned_through`, retention, skew).Scan(&h.Retention, &h.ClockSkew, &pruned)
	if err != nil {
		return Record{}, fmt.Errorf("enforce retention: %w", err)
	}
	if pruned != nil {
		h.PrunedThrough = *pruned
	}
	return h, nil
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
// refuses a retention shorter than the one recorded by Enforce
// (ErrRetentionBelowConsumers): a consumer could then accept a redelivery
// whose row is gone, and apply it twice. It refuses the first cut while
// untimed events still arrive, unless CutUntimed (ErrUntimedStillArriving).
//
// It records the cut before deleting anything, then waits until every guard
// transaction begun before the record has ended (see pgtier.Store.Begin): a claim either
// ran while the rows were still there, or is checked against the new cut.
func Prune(ctx context.Context, db *pgxpool.Pool, cfg PruneConfig) (int64, time.Time, error) {
	retention, skew, batch := cfg.Retention, cfg.ClockSkew, cfg.Batch
	if retention <= 0 || skew <= 0 || batch < 1 {
		return 0, time.Time{}, fmt.Errorf("prune: want a positive retention, clock skew and batch, got %s, %s and %d", retention, skew, batch)
	}
	var cutoff time.Time
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
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
	if err := barrier(ctx, db); err != nil {
		return 0, cutoff, fmt.Errorf("prune: wait for claims begun before the cut: %w", err)
	}
	var total int64
	for {
		tag, err := db.Exec(ctx, `DELETE FROM idem_processed WHERE ctid = ANY (ARRAY(
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

// barrierPoll is how often barrier looks again for the transactions it
// waits for.
const barrierPoll = 20 * time.Millisecond

// barrier returns once every guard transaction that held the horizon lock
// shared when it was called has ended. Called after the cut is recorded,
// that is every claim whose statement may have read the old horizon: a
// transaction that takes the lock later runs its claim later, and reads
// the new cut. It lists the holders' virtual transaction IDs once and
// waits for each to end, asking for no lock itself: an exclusive request
// would queue every later BEGIN behind it (PostgreSQL grants a lock's
// requests in order), so that claims failed at their lock_timeout for a
// prune's sake, and a bounded one could starve under claims that overlap.
func barrier(ctx context.Context, db *pgxpool.Pool) error {
	var holders []string
	err := db.QueryRow(ctx, `SELECT coalesce(array_agg(virtualtransaction), '{}') FROM pg_locks
		WHERE locktype = 'advisory' AND granted AND pid <> pg_backend_pid()
			AND (classid, objid, objsubid) = (`+lockKeyOIDs+`, 2)`).Scan(&holders)
	if err != nil {
		return err
	}
	for len(holders) > 0 {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(barrierPoll):
		}
		err := db.QueryRow(ctx, `SELECT coalesce(array_agg(virtualxid), '{}') FROM pg_locks
			WHERE locktype = 'virtualxid' AND virtualxid = ANY($1)`, holders).Scan(&holders)
		if err != nil {
			return err
		}
	}
	return nil
}

// Reset sets the recorded retention to retention, for an operator who
// lowered every consumer's retention: Enforce alone only ever
// raises it. The recorded clock skew is raised to skew, never lowered: the
// rows already kept were claimed under the larger one, and a cut is checked
// against it.
func Reset(ctx context.Context, db *pgxpool.Pool, retention, skew time.Duration) error {
	if retention <= 0 || skew <= 0 {
		return fmt.Errorf("reset horizon: want a positive retention and clock skew, got %s and %s", retention, skew)
	}
	_, err := db.Exec(ctx, `INSERT INTO idem_horizon (retention, clock_skew) VALUES ($1, $2)
		ON CONFLICT (id) DO UPDATE SET retention = EXCLUDED.retention,
			clock_skew = GREATEST(idem_horizon.clock_skew, EXCLUDED.clock_skew), updated_at = now()`,
		retention, skew)
	if err != nil {
		return fmt.Errorf("reset horizon: %w", err)
	}
	return nil
}
