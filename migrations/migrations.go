// Package migrations holds the guard's schema as numbered SQL files and
// applies the ones a database lacks. It creates only idem's own tables
// (idem_processed, idem_horizon, idem_shard, idem_stream, idem_outbox and
// its lanes and pauses, idem_instance, and the idem_migrations ledger), so it can run in a
// database that holds a service's other tables. Tables are created
// unqualified, in the first schema of the connection's search_path.
//
// A service keeps its own tables in a Set of its own, applied with ApplySet.
package migrations

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/internal/pgerr"
)

//go:embed *.sql
var files embed.FS

// Migration is one numbered SQL file.
type Migration struct {
	Version int
	Name    string
	SQL     string
}

// Set is a numbered series of migrations recorded in a ledger table of its
// own, so that two sets never share version numbers.
type Set struct {
	// Ledger is the table that records which versions ran.
	Ledger string
	// Files holds NNNN_name.sql files at its root.
	Files fs.FS
}

// SetIn is the set of the NNNN_name.sql files in dir of fsys (an embedded
// directory, say), recorded in ledger. It panics if dir is not a directory
// of fsys: the path is a literal of the caller's.
func SetIn(ledger string, fsys fs.FS, dir string) Set {
	sub, err := fs.Sub(fsys, dir)
	if err != nil {
		panic(fmt.Sprintf("migrations: %s: %v", dir, err))
	}
	return Set{Ledger: ledger, Files: sub}
}

// Guard is the guard's own set: the dedup rows, the horizon, the layout
// records and the outbox.
var Guard = Set{Ledger: "idem_migrations", Files: files}

// All returns the guard's migrations in version order.
func All() ([]Migration, error) { return Guard.All() }

// All returns the set's migrations in version order.
func (s Set) All() ([]Migration, error) {
	entries, err := fs.ReadDir(s.Files, ".")
	if err != nil {
		return nil, err
	}
	var out []Migration
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".sql") {
			continue
		}
		num, name, ok := strings.Cut(strings.TrimSuffix(e.Name(), ".sql"), "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil {
			return nil, fmt.Errorf("migration file %q: want NNNN_name.sql", e.Name())
		}
		b, err := fs.ReadFile(s.Files, e.Name())
		if err != nil {
			return nil, err
		}
		out = append(out, Migration{Version: v, Name: name, SQL: string(b)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// Conn is what Apply needs of a connection or pool.
type Conn interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Apply applies the guard's set (see ApplySet).
func Apply(ctx context.Context, db Conn) ([]Migration, error) { return ApplySet(ctx, db, Guard) }

// ApplySet runs, in one transaction, every migration of set not yet recorded
// in its ledger, and returns the ones it ran. Concurrent callers are
// serialised by an advisory lock, so a fleet may all run it at start. On a
// database where every migration of set is recorded it writes nothing and
// creates nothing, so a role with no CREATE privilege may call it.
func ApplySet(ctx context.Context, db Conn, set Set) ([]Migration, error) {
	ran, err := applySet(ctx, db, set)
	if pgerr.SQLState(err) == pgerr.InsufficientPrivilege {
		err = fmt.Errorf("%w: %s", err, needsMigrator)
	}
	return ran, err
}

func applySet(ctx context.Context, db Conn, set Set) ([]Migration, error) {
	all, err := set.All()
	if err != nil {
		return nil, err
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrate: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()

	ledger := pgx.Identifier{set.Ledger}.Sanitize()
	// A migration may build an index for minutes, and a fleet starting
	// together waits here for the first to finish: lift the session's
	// statement and lock bounds for this transaction (ctx still bounds it).
	if _, err := tx.Exec(ctx, `SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0`); err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext($1))`, set.Ledger); err != nil {
		return nil, fmt.Errorf("migrate: lock: %w", err)
	}
	// CREATE TABLE IF NOT EXISTS needs the CREATE privilege on the schema
	// even when the table exists: skip it then, so that a runtime role
	// without that privilege starts on a migrated database.
	exists, err := ledgerExists(ctx, tx, set.Ledger)
	if err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	if !exists {
		if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+ledger+` (
			version    int         PRIMARY KEY,
			name       text        NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
			return nil, fmt.Errorf("migrate: create %s: %w", set.Ledger, err)
		}
	}
	have, err := recorded(ctx, tx, set.Ledger)
	if err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	var ran []Migration
	for _, m := range all {
		if have[m.Version] {
			continue
		}
		if _, err := tx.Exec(ctx, m.SQL); err != nil {
			return nil, fmt.Errorf("migrate: %04d_%s: %w", m.Version, m.Name, err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+ledger+` (version, name) VALUES ($1, $2)`, m.Version, m.Name); err != nil {
			return nil, fmt.Errorf("migrate: record %04d: %w", m.Version, err)
		}
		ran = append(ran, m)
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("migrate: commit: %w", err)
	}
	return ran, nil
}

// Pending returns the migrations of set that its ledger does not record, in
// version order: every one where the ledger is not in the first schema of
// the search_path (where ApplySet would create it). It changes nothing: a
// service that does not migrate at start checks with it that someone did.
func Pending(ctx context.Context, db Conn, set Set) ([]Migration, error) {
	all, err := set.All()
	if err != nil {
		return nil, err
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrations: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	exists, err := ledgerExists(ctx, tx, set.Ledger)
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	have := map[int]bool{}
	if exists {
		if have, err = recorded(ctx, tx, set.Ledger); err != nil {
			return nil, fmt.Errorf("migrations: %w", err)
		}
	}
	var pending []Migration
	for _, m := range all {
		if !have[m.Version] {
			pending = append(pending, m)
		}
	}
	return pending, nil
}

// ledgerExists reports whether ledger is a table in the first schema of
// the search_path, where ApplySet creates it.
func ledgerExists(ctx context.Context, tx pgx.Tx, ledger string) (bool, error) {
	var exists bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = current_schema() AND tablename = $1)`,
		ledger).Scan(&exists); err != nil {
		return false, fmt.Errorf("look for %s: %w", ledger, err)
	}
	return exists, nil
}

// recorded returns the versions ledger records.
func recorded(ctx context.Context, tx pgx.Tx, ledger string) (map[int]bool, error) {
	rows, err := tx.Query(ctx, `SELECT version FROM `+pgx.Identifier{ledger}.Sanitize())
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", ledger, err)
	}
	done, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", ledger, err)
	}
	have := map[int]bool{}
	for _, v := range done {
		have[v] = true
	}
	return have, nil
}

// needsMigrator is what a role that may not create is told to do.
const needsMigrator = "this role may not apply idem's migrations: run `idem migrate` as the migrator role (docs/security.md), then start with --no-migrate (Migrate: false in the library)"
