package pgsession_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/pgsession"
)

// TestUnixSocketURLStillConnects: a DATABASE_URL that reaches
// PostgreSQL over its Unix socket (host=/var/run/postgresql: a local
// server, a sidecar, the Cloud SQL proxy's socket) connected before
// pgsession; Apply's dialler sets TCP_USER_TIMEOUT in its Control hook for
// every network, and setsockopt(IPPROTO_TCP) on an AF_UNIX socket fails.
func TestUnixSocketURLStillConnects(t *testing.T) {
	const url = "host=/var/run/postgresql user=postgres dbname=test connect_timeout=5"
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	plain, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	p, err := pgxpool.NewWithConfig(ctx, plain)
	require.NoError(t, err)
	defer p.Close()
	require.NoError(t, p.Ping(ctx), "the socket is reachable without pgsession")

	bounded, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	pgsession.Apply(bounded, pgsession.Bounds{Tx: 10 * time.Second})
	b, err := pgxpool.NewWithConfig(ctx, bounded)
	require.NoError(t, err)
	defer b.Close()
	require.NoError(t, b.Ping(ctx), "the same URL through pgsession.Apply")
}

// TestAURLsOptionsKeepTheirValue: Apply promises (and
// docs/operations.md says) that "a URL that sets one of them keeps its
// value"; the usual way to set a session GUC in a libpq URL is
// options=-c name=value. Apply only looks for the parameter's own name, and
// the server applies the startup packet's explicit parameters after
// options: the URL's statement_timeout=0 is silently replaced.
func TestAURLsOptionsKeepTheirValue(t *testing.T) {
	const url = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable&options=-c%20statement_timeout%3D0%20-c%20lock_timeout%3D0"
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pc, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	pgsession.Apply(pc, pgsession.Bounds{Tx: time.Second})
	p, err := pgxpool.NewWithConfig(ctx, pc)
	require.NoError(t, err)
	defer p.Close()
	var st, lt string
	require.NoError(t, p.QueryRow(ctx, `SELECT current_setting('statement_timeout'), current_setting('lock_timeout')`).Scan(&st, &lt))
	require.Equal(t, "0", st, "statement_timeout the URL set")
	require.Equal(t, "0", lt, "lock_timeout the URL set")
}

// TestEverySessionIsBounded: a pool through Apply has every bound set on
// each session, and a transaction may lift one for itself.
func TestEverySessionIsBounded(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pc, err := pgxpool.ParseConfig("postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	require.NoError(t, err)
	pgsession.Apply(pc, pgsession.Bounds{Tx: 2 * time.Second})
	p, err := pgxpool.NewWithConfig(ctx, pc)
	require.NoError(t, err)
	defer p.Close()
	for name, want := range map[string]string{
		"idle_in_transaction_session_timeout": "7s", "statement_timeout": "7s", "lock_timeout": "1s",
		"tcp_keepalives_idle": "5", "tcp_keepalives_interval": "5", "tcp_keepalives_count": "3", "tcp_user_timeout": "20000",
	} {
		var got string
		require.NoError(t, p.QueryRow(ctx, `SELECT current_setting($1)`, name).Scan(&got))
		require.Equal(t, want, got, name)
	}
}
