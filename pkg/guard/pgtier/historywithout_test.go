package pgtier_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/layout"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
)

// TestAHistoryWithoutARefusedFunctionIsTakenKnowingly: on a server of the
// test's own where pg_control_system is revoked from PUBLIC (as a managed
// service may), the runtime role cannot read the full history and the
// start-up check names the function; with HistoryWithout it reads a
// history that leaves the part out (another value than the full one's,
// stable), and the start-up check passes. An unknown part is refused;
// with no part left out NewWith reads New's history.
func TestAHistoryWithoutARefusedFunctionIsTakenKnowingly(t *testing.T) {
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

	full, err := pgtier.New(admin).History(ctx)
	require.NoError(t, err)
	same, err := pgtier.NewWith(admin, pgtier.Options{})
	require.NoError(t, err)
	h, err := same.History(ctx)
	require.NoError(t, err)
	require.Equal(t, full, h, "no part left out: the history of every marker written so far")

	_, err = admin.Exec(ctx, "REVOKE EXECUTE ON FUNCTION pg_control_system() FROM PUBLIC")
	require.NoError(t, err)
	_, err = pgtier.New(role).History(ctx)
	require.ErrorContains(t, err, "permission denied for function pg_control_system")
	require.ErrorContains(t, layout.CheckGuardCalls(ctx, role, pgtier.New(role).History), "GRANT EXECUTE ON FUNCTION pg_control_system()")

	without := pgtier.Options{HistoryWithout: []string{"pg_control_system"}}
	st, err := pgtier.NewWith(role, without)
	require.NoError(t, err)
	h1, err := st.History(ctx)
	require.NoError(t, err)
	h2, err := st.History(ctx)
	require.NoError(t, err)
	require.Equal(t, h1, h2)
	require.NotEqual(t, full, h1)
	require.NoError(t, layout.CheckGuardCalls(ctx, role, st.History, without.HistoryWithout...))
	tx, err := st.Begin(ctx)
	require.NoError(t, err)
	_, claimed, err := st.Claim(ctx, tx, "svc", []guard.Event{{ID: "e1", Hash: guard.HashFields("x"), Time: time.Now()}})
	require.NoError(t, err, "the claim reads the same history")
	require.Equal(t, h1, claimed)
	require.NoError(t, tx.Commit(ctx))

	_, err = pgtier.NewWith(role, pgtier.Options{HistoryWithout: []string{"pg_database"}})
	require.ErrorContains(t, err, `history part "pg_database"`)
}
