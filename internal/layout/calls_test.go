package layout_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/layout"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/guard/pgtier"
)

// TestTheGuardsCallsAreCheckedAtStart: on a migrated database the calls a
// claim makes pass; a history the role cannot read is said at start,
// naming the functions; a partitioned idem_processed, whose file node the
// history cannot read, is refused.
func TestTheGuardsCallsAreCheckedAtStart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := testenv.Schema(t)
	require.NoError(t, layout.CheckGuardCalls(ctx, pool, pgtier.New(pool).History))

	denied := func(context.Context) (tier.History, error) {
		return "", errors.New("ERROR: permission denied for function pg_control_system (SQLSTATE 42501)")
	}
	err := layout.CheckGuardCalls(ctx, pool, denied)
	require.ErrorContains(t, err, "the guard cannot read the database's history (pg_control_system")

	_, err = pool.Exec(ctx, `DROP TABLE idem_processed CASCADE;
		CREATE TABLE idem_processed (scope text NOT NULL, event_id text NOT NULL, PRIMARY KEY (scope, event_id)) PARTITION BY HASH (scope)`)
	require.NoError(t, err)
	require.ErrorIs(t, layout.CheckGuardCalls(ctx, pool, pgtier.New(pool).History), layout.ErrPartitionedDedupTable)
}

// TestEachGuardCallRevokedIsNamedAtStart: on a server of the test's own
// (the revokes are server-wide), each function a claim calls is revoked
// from PUBLIC in turn, as a managed service may, and the runtime role
// (not a superuser) is refused at start naming that function and the
// GRANT that fixes it; once granted to the role, the next is checked.
func TestEachGuardCallRevokedIsNamedAtStart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	srv := testenv.StartPostgres(t)
	admin, schemaURL := testenv.SchemaOn(t, srv.URL())
	roleURL := testenv.Role(t, schemaURL,
		"GRANT USAGE ON SCHEMA {schema} TO {role}",
		"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role}")
	role, err := pgxpool.New(ctx, roleURL)
	require.NoError(t, err)
	t.Cleanup(role.Close)
	var name string
	require.NoError(t, role.QueryRow(ctx, `SELECT current_user`).Scan(&name))
	require.NoError(t, layout.CheckGuardCalls(ctx, role, pgtier.New(role).History), "every call is PUBLIC by default")

	for _, c := range layout.GuardCalls {
		_, err := admin.Exec(ctx, "REVOKE EXECUTE ON FUNCTION "+c.Function+" FROM PUBLIC")
		require.NoError(t, err, c.Function)
		err = layout.CheckGuardCalls(ctx, role, pgtier.New(role).History)
		var ce *layout.CallError
		require.ErrorAs(t, err, &ce, c.Function)
		require.Equal(t, c.Function, ce.Call.Function)
		require.ErrorContains(t, err, "GRANT EXECUTE ON FUNCTION "+c.Function+" TO "+name)
		require.ErrorContains(t, err, "permission denied for function")
		_, err = admin.Exec(ctx, "GRANT EXECUTE ON FUNCTION "+c.Function+" TO "+name)
		require.NoError(t, err, c.Function)
	}
	require.NoError(t, layout.CheckGuardCalls(ctx, role, pgtier.New(role).History), "each granted to the role alone")
}
