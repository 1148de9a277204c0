package layout

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/internal/tier"
)

// ErrPartitionedDedupTable: idem_processed is a partitioned table, whose
// parent has no file node for the database's history to read: a TRUNCATE
// or a restore of it under a running server would go unseen, and done
// markers written before it would still be trusted.
var ErrPartitionedDedupTable = errors.New("idem_processed is partitioned, which idem does not support: the database's history cannot see it truncated or restored")

// GuardCall is a function the guard's statements call beyond plain SQL,
// which a role without EXECUTE, a standby, or an engine that lacks it
// refuses.
type GuardCall struct {
	Function string // as GRANT EXECUTE ON FUNCTION names it
	SQL      string // a statement that calls it alone
	Why      string // what the guard reads or writes with it
}

// GuardCalls are the functions a claim calls, in the order CheckGuardCalls
// tries them. The first six make the database's history (see
// pgtier.History); the lock follows; the others commit the WAL message of a
// claim that only finds rows.
var GuardCalls = []GuardCall{
	{"pg_control_system()", `SELECT system_identifier FROM pg_control_system()`,
		"the cluster's system identifier, which tells a dump restored into another cluster"},
	{"pg_current_wal_lsn()", `SELECT pg_current_wal_lsn()`,
		"the WAL position, which a standby refuses as it refuses the claim's INSERT"},
	{"pg_walfile_name(pg_lsn)", `SELECT pg_walfile_name('0/0'::pg_lsn)`,
		"the timeline in the current WAL file's name, which a failover or a point-in-time restore changes"},
	{"pg_postmaster_start_time()", `SELECT pg_postmaster_start_time()`,
		"when the server started, which tells a file-system snapshot put back"},
	{"pg_relation_filenode(regclass)", `SELECT pg_relation_filenode(to_regclass('idem_processed'))`,
		"the dedup table's file node, which tells it truncated or restored under a running server"},
	{"pg_relation_filepath(regclass)", `SELECT pg_relation_filepath('pg_catalog.pg_class')`,
		"pg_class's file path, which names the database's OID, which tells a dump restored into a re-created database"},
	{"pg_advisory_xact_lock_shared(integer, integer)", `SELECT pg_advisory_xact_lock_shared(1, 1)`,
		"the lock every claim holds so that prune waits for it"},
	{"pg_logical_emit_message(boolean, text, text)", `SELECT pg_logical_emit_message(true, 'idem', '')`,
		"the WAL message a claim that only finds rows commits, so that a synchronous standby has them before they are acked"},
	{"pg_current_wal_flush_lsn()", `SELECT pg_current_wal_flush_lsn()`,
		"the WAL positions a claim that only finds rows reads to know whether it needs its WAL message"},
	{"pg_current_wal_insert_lsn()", `SELECT pg_current_wal_insert_lsn()`,
		"the WAL positions a claim that only finds rows reads to know whether it needs its WAL message"},
}

// CallError is a guard call the database refused at start.
type CallError struct {
	Call GuardCall
	Role string // current_user
	Err  error
}

func (e *CallError) Error() string {
	return fmt.Sprintf("the guard cannot call %s (%s): %v. Remedy: as a superuser (or the function's owner), GRANT EXECUTE ON FUNCTION %s TO %s; "+
		"on a standby, point idem at the primary; on a managed service that refuses it, see \"Managed PostgreSQL\" in docs/operations.md",
		e.Call.Function, e.Call.Why, e.Err, e.Call.Function, e.Role)
}

func (e *CallError) Unwrap() error { return e.Err }

// leftOut reports whether the history part without names calls c alone
// (pg_walfile_name reads pg_current_wal_lsn only for the history; without
// the file node, the database's OID is read from the catalog, not from the
// file path).
func (c GuardCall) leftOut(without []string) bool {
	for _, w := range without {
		if strings.HasPrefix(c.Function, w+"(") || (w == "pg_walfile_name" && c.Function == "pg_current_wal_lsn()") ||
			(w == "pg_relation_filenode" && c.Function == "pg_relation_filepath(regclass)") {
			return true
		}
	}
	return false
}

// CheckGuardCalls checks, at start, what the guard's claims call beyond
// plain SQL (GuardCalls, each alone, in a transaction rolled back here),
// and then the store's own read of the history, so that a role, a standby
// or an engine without one is told at once, naming the function and the
// GRANT, instead of failing every claim. It also refuses a partitioned
// idem_processed.
//
// The functions of the history parts without names (pgtier's
// HistoryWithout) are not checked: the history leaves them out.
func CheckGuardCalls(ctx context.Context, pool *pgxpool.Pool, history func(context.Context) (tier.History, error), without ...string) error {
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
	// All at once first, as a claim makes them: one transaction, three
	// statements. Only if that fails is each tried alone, to name it.
	if err := tryCalls(ctx, pool, without); err == nil {
		if _, err := history(ctx); err != nil {
			return fmt.Errorf("the guard cannot read the database's history (%s): %w", historyCalls(), err)
		}
		return nil
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	var role string
	if err := tx.QueryRow(ctx, `SELECT current_user`).Scan(&role); err != nil {
		return err
	}
	for i, c := range GuardCalls {
		if c.leftOut(without) {
			continue
		}
		sp := fmt.Sprintf("idem_call_%d", i)
		if _, err := tx.Exec(ctx, "SAVEPOINT "+sp); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, c.SQL); err != nil {
			if !refused(err) {
				return err
			}
			return &CallError{Call: c, Role: role, Err: err}
		}
	}
	if _, err := history(ctx); err != nil {
		return fmt.Errorf("the guard cannot read the database's history (%s): %w", historyCalls(), err)
	}
	return nil
}

// refused reports whether err is the database refusing a call as such
// (no privilege, no such function, not on a standby, a feature the engine
// lacks), not a connection or a timeout, which the caller retries.
func refused(err error) bool {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		return false
	}
	switch pe.Code[:2] {
	case "42", "55", "0A", "25", "38", "39", "XX":
		return true
	}
	return false
}

func historyCalls() string {
	var names []string
	for _, c := range GuardCalls[:6] {
		names = append(names, c.Function)
	}
	return strings.Join(names, ", ")
}

// tryCalls makes every call of GuardCalls but those without leaves out in
// one statement, in a transaction it rolls back.
func tryCalls(ctx context.Context, pool *pgxpool.Pool, without []string) error {
	var sel []string
	for _, c := range GuardCalls {
		if !c.leftOut(without) {
			sel = append(sel, "("+c.SQL+")")
		}
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	_, err = tx.Exec(ctx, "SELECT "+strings.Join(sel, ", "))
	return err
}
