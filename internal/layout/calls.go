package layout

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/internal/tier"
)

// ErrPartitionedDedupTable: idem_processed is a partitioned table, whose
// parent has no file node for the database's history to read: a TRUNCATE
// or a restore of it under a running server would go unseen, and done
// markers written before it would still be trusted.
var ErrPartitionedDedupTable = errors.New("idem_processed is partitioned, which idem does not support: the database's history cannot see it truncated or restored")

// CheckGuardCalls checks, at start, what the guard's claims call beyond
// plain SQL, so that a role or an engine without it is told at once
// instead of failing every claim: the database's history (history: the
// store's read of it; pg_control_system, pg_current_wal_lsn and
// pg_postmaster_start_time, which a standby or a revoked EXECUTE refuses),
// and the WAL message a claim that only finds rows commits
// (pg_logical_emit_message, in a transaction rolled back here) with the WAL
// positions it reads to know whether it needs it. It also
// refuses a partitioned idem_processed.
func CheckGuardCalls(ctx context.Context, pool *pgxpool.Pool, history func(context.Context) (tier.History, error)) error {
	var kind string
	err := pool.QueryRow(ctx, `SELECT relkind::text FROM pg_class WHERE oid = to_regclass('idem_processed')`).Scan(&kind)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return nil // CheckShard and the migration check say what is missing
	case err != nil:
		return err
	case kind == "p":
		return ErrPartitionedDedupTable
	}
	if _, err := history(ctx); err != nil {
		return fmt.Errorf("the guard cannot read the database's history (pg_control_system, pg_current_wal_lsn, pg_postmaster_start_time: is it a standby, or was EXECUTE revoked from the role?): %w", err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, `SELECT pg_logical_emit_message(true, 'idem', '')`); err != nil {
		return fmt.Errorf("the guard cannot write a WAL message (pg_logical_emit_message, which a claim that only finds rows commits so that a synchronous standby has them before they are acked): %w", err)
	}
	if _, err := tx.Exec(ctx, `SELECT current_setting('synchronous_standby_names'), pg_current_wal_flush_lsn() >= pg_current_wal_insert_lsn()`); err != nil {
		return fmt.Errorf("the guard cannot read the WAL positions (pg_current_wal_flush_lsn, pg_current_wal_insert_lsn, which a claim that only finds rows reads to know whether it needs its WAL message): %w", err)
	}
	return nil
}
