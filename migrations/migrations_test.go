package migrations_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/migrations"
)

// TestGuardMigrationsTouchOnlyIdemTables: in a service's database that
// already has tables of its own, even ones named like the reference
// handler's, the guard's migrations create their tables and nothing else.
func TestGuardMigrationsTouchOnlyIdemTables(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.EmptySchema(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `CREATE TABLE account_balances (account text PRIMARY KEY, cents bigint)`)
	require.NoError(t, err)
	ran, err := migrations.Apply(ctx, pool)
	require.NoError(t, err)
	require.NotEmpty(t, ran)

	var tables []string
	rows, err := pool.Query(ctx, `SELECT table_name FROM information_schema.tables
		WHERE table_schema = current_schema() ORDER BY table_name`)
	require.NoError(t, err)
	for rows.Next() {
		var n string
		require.NoError(t, rows.Scan(&n))
		tables = append(tables, n)
	}
	require.Equal(t, []string{"account_balances", "idem_horizon", "idem_instance", "idem_migrations", "idem_outbox", "idem_outbox_lane", "idem_outbox_pause", "idem_processed", "idem_shard", "idem_stream"}, tables)

	again, err := migrations.Apply(ctx, pool)
	require.NoError(t, err)
	require.Empty(t, again, "applied twice")
}

// TestPendingSaysWhatALedgerLacks: Pending lists every migration of a set
// whose ledger is absent, the newer ones of a ledger that is behind, none
// once the set is applied, and creates nothing while it looks.
func TestPendingSaysWhatALedgerLacks(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.EmptySchema(t)
	ctx := context.Background()
	all, err := migrations.All()
	require.NoError(t, err)
	pending, err := migrations.Pending(ctx, pool, migrations.Guard)
	require.NoError(t, err)
	require.Equal(t, all, pending)
	var tables int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_tables WHERE schemaname = current_schema()`).Scan(&tables))
	require.Zero(t, tables, "Pending created a table")

	_, err = migrations.Apply(ctx, pool)
	require.NoError(t, err)
	pending, err = migrations.Pending(ctx, pool, migrations.Guard)
	require.NoError(t, err)
	require.Empty(t, pending)

	last := all[len(all)-1]
	_, err = pool.Exec(ctx, `DELETE FROM idem_migrations WHERE version = $1`, last.Version)
	require.NoError(t, err)
	pending, err = migrations.Pending(ctx, pool, migrations.Guard)
	require.NoError(t, err)
	require.Equal(t, []migrations.Migration{last}, pending)
}

// runtimeGrants are the runtime role's grants of docs/security.md: rows
// only, no CREATE.
var runtimeGrants = []string{
	"GRANT USAGE ON SCHEMA {schema} TO {role}",
	"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role}",
	"GRANT USAGE ON ALL SEQUENCES IN SCHEMA {schema} TO {role}",
}

// TestARoleThatMayNotCreateAppliesNothingQuietly: on a migrated schema, a
// role without the CREATE privilege runs Apply (as every start-up does)
// without an error and without creating anything; on a schema that lacks
// the migrations, the same role is refused.
func TestARoleThatMayNotCreateAppliesNothingQuietly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, u := testenv.Schema(t)
	runtime, err := pgxpool.New(ctx, testenv.Role(t, u, runtimeGrants...))
	require.NoError(t, err)
	defer runtime.Close()
	ran, err := migrations.Apply(ctx, runtime)
	require.NoError(t, err, "a migrated schema needs no CREATE")
	require.Empty(t, ran)

	_, empty := testenv.EmptySchema(t)
	runtime2, err := pgxpool.New(ctx, testenv.Role(t, empty, runtimeGrants...))
	require.NoError(t, err)
	defer runtime2.Close()
	_, err = migrations.Apply(ctx, runtime2)
	require.ErrorContains(t, err, "permission denied", "the role may not create: the test would prove nothing")
	require.ErrorContains(t, err, "run `idem migrate` as the migrator role", "and it is told what to do")
}
