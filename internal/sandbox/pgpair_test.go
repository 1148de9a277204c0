package sandbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
)

// TestAPairFailsOver: through the front link, a row committed while the
// standby streams survives the failover; with an asynchronous standby, a
// row committed after the replication was cut is lost, and the promoted
// standby is on a new timeline of the same cluster; with a synchronous
// one, a commit after the cut waits, and the client hears the primary die
// rather than a success. The new primary then gets a standby of its own,
// which receives its commits.
func TestAPairFailsOver(t *testing.T) {
	t.Parallel()
	for _, sync := range []bool{false, true} {
		name := "async"
		if sync {
			name = "sync"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			p := testenv.StartPair(t, sandbox.PairConfig{Synchronous: sync, ReplicationLatency: 20 * time.Millisecond})
			ctx := context.Background()
			c, err := pgx.Connect(ctx, p.URL())
			require.NoError(t, err)
			var sysid int64
			var timeline string
			identity := `SELECT system_identifier, left(pg_walfile_name(pg_current_wal_lsn()), 8) FROM pg_control_system()`
			require.NoError(t, c.QueryRow(ctx, identity).Scan(&sysid, &timeline))
			_, err = c.Exec(ctx, `CREATE TABLE t (v text); INSERT INTO t VALUES ('before')`)
			require.NoError(t, err)
			// The standby has it once it has replayed it: wait for that
			// on the standby, directly.
			sb, err := pgx.Connect(ctx, p.Standby.URL())
			require.NoError(t, err)
			require.Eventually(t, func() bool {
				var n int
				return sb.QueryRow(ctx, `SELECT count(*) FROM t`).Scan(&n) == nil && n == 1
			}, 10*time.Second, 20*time.Millisecond)
			sb.Close(ctx)

			require.NoError(t, p.CutReplication())
			after := make(chan error, 1)
			go func() { _, err := c.Exec(ctx, `INSERT INTO t VALUES ('after')`); after <- err }()
			if sync {
				select {
				case err := <-after:
					t.Fatalf("a commit returned while the synchronous standby was cut off: %v", err)
				case <-time.After(500 * time.Millisecond):
				}
			} else {
				require.NoError(t, <-after)
			}
			require.NoError(t, p.KillPrimary())
			if sync {
				require.Error(t, <-after, "the waiting commit hears the primary die")
			}
			require.NoError(t, p.Promote())
			require.NoError(t, p.Repoint())

			c2, err := pgx.Connect(ctx, p.URL())
			require.NoError(t, err)
			defer c2.Close(ctx)
			var sysid2 int64
			var timeline2 string
			require.NoError(t, c2.QueryRow(ctx, identity).Scan(&sysid2, &timeline2))
			require.Equal(t, sysid, sysid2, "the same cluster")
			require.NotEqual(t, timeline, timeline2, "a new timeline")
			var rows []string
			r, err := c2.Query(ctx, `SELECT v FROM t ORDER BY v`)
			require.NoError(t, err)
			rows, err = pgx.CollectRows(r, pgx.RowTo[string])
			require.NoError(t, err)
			require.Equal(t, []string{"before"}, rows, "the commit after the cut is lost (async) or never returned (sync)")

			require.NoError(t, p.AddStandby())
			_, err = c2.Exec(ctx, `INSERT INTO t VALUES ('again')`)
			require.NoError(t, err)
			sb2, err := pgx.Connect(ctx, p.Standby.URL())
			require.NoError(t, err)
			defer sb2.Close(ctx)
			require.Eventually(t, func() bool {
				var n int
				return sb2.QueryRow(ctx, `SELECT count(*) FROM t`).Scan(&n) == nil && n == 2
			}, 10*time.Second, 20*time.Millisecond, "the new standby receives the new primary's commits")
		})
	}
}
