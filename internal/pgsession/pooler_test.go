package pgsession_test

import (
	"context"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/pgsession"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
)

// bouncer starts a PgBouncer of the test's own pooling as mode says, and
// returns a URL for the test database through it.
func bouncer(t *testing.T, mode string) string {
	t.Helper()
	u, err := url.Parse(testenv.DatabaseURL())
	require.NoError(t, err)
	return testenv.PgBouncer(t, sandbox.PgBouncerOptions{Mode: mode, PoolSize: 3}).URL(u.Path[1:])
}

// TestProbeFindsATransactionPooler: the probe says "pooled" through
// PgBouncer in transaction mode, and not on a direct connection nor
// through a session-mode pool (where named prepared statements work).
func TestProbeFindsATransactionPooler(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name   string
		url    string
		pooled bool
	}{
		{"direct", testenv.DatabaseURL(), false},
		{"transaction", bouncer(t, "transaction"), true},
		{"session", bouncer(t, "session"), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			for range 3 {
				a, err := pgx.Connect(ctx, c.url+"&default_query_exec_mode=simple_protocol")
				require.NoError(t, err)
				b, err := pgx.Connect(ctx, c.url+"&default_query_exec_mode=simple_protocol")
				require.NoError(t, err)
				pooled, err := pgsession.Probe(ctx, a, b)
				require.NoError(t, err)
				require.Equal(t, c.pooled, pooled)
				a.Close(ctx)
				b.Close(ctx)
			}
		})
	}
}

// TestAPoolBehindATransactionPoolerPreparesNothing: through PgBouncer in
// transaction mode, a pool from the default URL runs many clients'
// statements without one prepared-statement error (pgx's default cache
// failed with 26000 or 42P05) and sets no session setting (it would stay on
// the pooler's server connections); a URL that asks for cache_statement is
// refused with the parameter to set.
func TestAPoolBehindATransactionPoolerPreparesNothing(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	via := bouncer(t, "transaction")
	for round := range 3 { // new clients meet the server sessions the last ones left
		pc, err := pgxpool.ParseConfig(via)
		require.NoError(t, err)
		pgsession.Apply(pc, pgsession.Bounds{Tx: 10 * time.Second})
		pool, err := pgxpool.NewWithConfig(ctx, pc)
		require.NoError(t, err)
		errs := make(chan error, 8)
		for w := range 8 {
			go func() {
				var err error
				for i := range 50 {
					var n int
					if err = pool.QueryRow(ctx, `SELECT $1::int + $2::int`, w, i).Scan(&n); err != nil {
						break
					}
					if _, err = pool.Exec(ctx, `SELECT count(*) FROM pg_class WHERE relname = $1`, "x"); err != nil {
						break
					}
				}
				errs <- err
			}()
		}
		for range 8 {
			require.NoError(t, <-errs, "round %d", round)
		}
		var timeout string
		require.NoError(t, pool.QueryRow(ctx, `SELECT current_setting('idle_in_transaction_session_timeout')`).Scan(&timeout))
		require.Equal(t, "0", timeout, "a session setting reached a server connection the pooler shares")
		pool.Close()
	}

	pc, err := pgxpool.ParseConfig(via + "&default_query_exec_mode=cache_statement")
	require.NoError(t, err)
	pgsession.Apply(pc, pgsession.Bounds{})
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	require.NoError(t, err)
	defer pool.Close()
	err = pool.Ping(ctx)
	require.ErrorContains(t, err, "set default_query_exec_mode=cache_describe")
}
