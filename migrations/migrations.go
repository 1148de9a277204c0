// Package migrations holds idem's schema as numbered SQL files and applies
// the ones a database lacks. Tables are created unqualified, in the first
// schema of the connection's search_path.
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
)

//go:embed *.sql
var files embed.FS

// Migration is one numbered SQL file.
type Migration struct {
	Version int
	Name    string
	SQL     string
}

// All returns the embedded migrations in version order.
func All() ([]Migration, error) {
	entries, err := fs.ReadDir(files, ".")
	if err != nil {
		return nil, err
	}
	var out []Migration
	for _, e := range entries {
		num, name, ok := strings.Cut(strings.TrimSuffix(e.Name(), ".sql"), "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil {
			return nil, fmt.Errorf("migration file %q: want NNNN_name.sql", e.Name())
		}
		b, err := files.ReadFile(e.Name())
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

// Apply runs, in one transaction, every migration not yet recorded in
// idem_migrations, and returns the ones it ran. Concurrent callers are
// serialised by an advisory lock, so a fleet may all run it at start.
func Apply(ctx context.Context, db Conn) ([]Migration, error) {
	all, err := All()
	if err != nil {
		return nil, err
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrate: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()

	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('idem_migrations'))`); err != nil {
		return nil, fmt.Errorf("migrate: lock: %w", err)
	}
	if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS idem_migrations (
		version    int         PRIMARY KEY,
		name       text        NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return nil, fmt.Errorf("migrate: create idem_migrations: %w", err)
	}
	rows, err := tx.Query(ctx, `SELECT version FROM idem_migrations`)
	if err != nil {
		return nil, fmt.Errorf("migrate: read idem_migrations: %w", err)
	}
	done, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return nil, fmt.Errorf("migrate: read idem_migrations: %w", err)
	}
	have := map[int]bool{}
	for _, v := range done {
		have[v] = true
	}
	var ran []Migration
	for _, m := range all {
		if have[m.Version] {
			continue
		}
		if _, err := tx.Exec(ctx, m.SQL); err != nil {
			return nil, fmt.Errorf("migrate: %04d_%s: %w", m.Version, m.Name, err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO idem_migrations (version, name) VALUES ($1, $2)`, m.Version, m.Name); err != nil {
			return nil, fmt.Errorf("migrate: record %04d: %w", m.Version, err)
		}
		ran = append(ran, m)
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("migrate: commit: %w", err)
	}
	return ran, nil
}
