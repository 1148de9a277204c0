package idem_test

import (
	"context"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/migrations"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/idem"
)

// TestBehindATransactionPoolerAServiceRunsOrSaysWhatToSet: through
// PgBouncer in transaction mode, a service given DatabaseURL runs (its own
// pool prepares no named statement); one given a pool of its own with
// pgx's default exec mode is refused at start with the setting to change,
// before a claim could fail with 26000 or 42P05; the same pool with
// cache_describe runs.
func TestBehindATransactionPoolerAServiceRunsOrSaysWhatToSet(t *testing.T) {
	t.Parallel()
	direct, _ := testenv.Database(t)
	u, err := url.Parse(direct)
	require.NoError(t, err)
	via := testenv.PgBouncer(t, sandbox.PgBouncerOptions{}).URL(u.Path[1:])
	queue := testenv.Queue(t, testenv.AMQPURL())
	cfg := func() idem.Config {
		return idem.Config{Scope: "pay", Migrate: true, Migrations: []migrations.Set{testenv.Effects},
			Consumer: consumer.Config{URL: testenv.AMQPURL(), Queue: queue}}
	}
	runs := func(c idem.Config) {
		t.Helper()
		select {
		case err := <-reviewStart(t, c):
			t.Fatalf("the service stopped: %v", err)
		case <-time.After(3 * time.Second):
		}
	}

	c := cfg()
	c.DatabaseURL = via
	runs(c)

	pool, err := pgxpool.New(context.Background(), via)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	c = cfg()
	c.Databases = []*pgxpool.Pool{pool}
	select {
	case err := <-reviewStart(t, c):
		require.ErrorContains(t, err, "default_query_exec_mode=cache_describe")
		require.ErrorContains(t, err, "pgx.QueryExecModeCacheDescribe")
	case <-time.After(30 * time.Second):
		t.Fatal("a pool that prepares named statements behind a transaction pooler was taken")
	}

	pc, err := pgxpool.ParseConfig(via)
	require.NoError(t, err)
	pc.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe
	fitted, err := pgxpool.NewWithConfig(context.Background(), pc)
	require.NoError(t, err)
	t.Cleanup(fitted.Close)
	c = cfg()
	c.Databases = []*pgxpool.Pool{fitted}
	runs(c)
}
