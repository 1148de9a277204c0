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
func bouncer(t *testing.T, mode string, settings ...string) string {
	t.Helper()
	return bouncerWith(t, sandbox.PgBouncerOptions{Mode: mode, PoolSize: 3, Settings: settings})
}

func bouncerWith(t *testing.T, o sandbox.PgBouncerOptions) string {
	t.Helper()
	u, err := url.Parse(testenv.DatabaseURL())
	require.NoError(t, err)
	return testenv.PgBouncer(t, o).URL(u.Path[1:])
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
		// Each server connection reset after each transaction: no other
		// client sees the probe's statement, but the probe no longer
		// sees its own either (the probe took this for direct).
		{"transaction, reset after each", bouncer(t, "transaction", "server_reset_query_always = 1"), true},
		{"transaction, round robin", bouncer(t, "transaction", "server_round_robin = 1"), true},
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

// TestAServicesPoolWithOneConnectionIsStillChecked: CheckPool probed on
// two connections taken from the pool, and a pool of one (pool_max_conns=1)
// could not give the second: it answered "no pooler" and the pool that
// prepares named statements was taken. It probes on connections of its
// own now.
func TestAServicesPoolWithOneConnectionIsStillChecked(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, bouncer(t, "transaction")+"&pool_max_conns=1")
	require.NoError(t, err)
	defer pool.Close()
	require.ErrorIs(t, pgsession.CheckPool(ctx, pool), pgsession.ErrPooledStatements)
	direct, err := pgxpool.New(ctx, testenv.DatabaseURL()+"&pool_max_conns=1")
	require.NoError(t, err)
	defer direct.Close()
	require.NoError(t, pgsession.CheckPool(ctx, direct))
}

// TestABusyPoolerDelaysAConnectionAndNeverFailsIt: the pooler's only
// server connection is busy for 7 s when a pool's first connection is
// made. The probe, bounded by 5 s, failed the connection with its timeout
// (a start-up that retries nothing on a timeout ended there); now a probe
// that cannot answer fails nothing, and the connection is made once the
// server connection is free.
func TestABusyPoolerDelaysAConnectionAndNeverFailsIt(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	via := bouncerWith(t, sandbox.PgBouncerOptions{PoolSize: 1})
	busy, err := pgx.Connect(ctx, via+"&default_query_exec_mode=simple_protocol")
	require.NoError(t, err)
	defer busy.Close(ctx)
	held := make(chan error, 1)
	go func() { _, err := busy.Exec(ctx, `SELECT pg_sleep(7)`); held <- err }()
	time.Sleep(300 * time.Millisecond)

	pc, err := pgxpool.ParseConfig(via)
	require.NoError(t, err)
	pgsession.Apply(pc, pgsession.Bounds{Tx: 10 * time.Second})
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	require.NoError(t, err)
	defer pool.Close()
	var one int
	require.NoError(t, pool.QueryRow(ctx, `SELECT 1`).Scan(&one))
	require.NoError(t, <-held)
	// A probe answers on a later connection: through the pooler, nothing
	// is prepared by name.
	for i := range 20 {
		require.NoError(t, pool.QueryRow(ctx, `SELECT $1::int`, i).Scan(&one))
	}
}
