package guard_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/migrations"
	"github.com/idemhq/idem/pkg/guard"
)

// migrated opens a pool on dbURL and applies the guard's tables and the
// test handler's.
func migrated(t *testing.T, dbURL string) *pgxpool.Pool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, dbURL)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	for _, set := range []migrations.Set{migrations.Guard, testenv.Effects} {
		_, err := migrations.ApplySet(ctx, pool, set)
		require.NoError(t, err)
	}
	return pool
}

// TestARestoredDumpIsANewHistory: a database is put back to a dump taken
// before an event was applied, either re-created and restored (the dump's
// rows, a generation row among them if there were one, come back alike;
// the database's OID does not) or restored over itself with --clean. The
// event, re-sent to the same guard while its done marker still lives in
// Redis, is applied once again instead of being dropped as a duplicate;
// an event the dump holds is a duplicate, found by the database.
func TestARestoredDumpIsANewHistory(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name     string
		recreate bool
	}{
		{"into a re-created database", true},
		{"over itself, with --clean", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			dbURL, recreate := testenv.Database(t)
			pool := migrated(t, dbURL)
			g, _, _ := redisRig(t, pool)

			before, after := event("evt_before", 1), event("evt_after", 1)
			require.Equal(t, guard.OutcomeProcessed, processAgain(t, g, before))
			dump := filepath.Join(t.TempDir(), "dump")
			testenv.RunPostgresTool(t, "pg_dump", "-Fc", "-f", dump, "-d", dbURL)
			require.Equal(t, guard.OutcomeProcessed, processAgain(t, g, after))
			require.Equal(t, guard.OutcomeDuplicateRedis, processAgain(t, g, after), "the marker is trusted before the restore")

			if c.recreate {
				recreate()
				testenv.RunPostgresTool(t, "pg_restore", "-d", dbURL, dump)
			} else {
				testenv.RunPostgresTool(t, "pg_restore", "--clean", "--if-exists", "-d", dbURL, dump)
			}
			require.Equal(t, 0, ledgerRowsAt(t, dbURL, after.ID), "the restore's premise")

			require.Equal(t, guard.OutcomeProcessed, processAgain(t, g, after), "dropped on a marker of the history before the restore")
			require.Equal(t, 1, ledgerRowsAt(t, dbURL, after.ID))
			require.Equal(t, guard.OutcomeDuplicatePostgres, processAgain(t, g, before))
			require.Equal(t, guard.OutcomeDuplicateRedis, processAgain(t, g, before), "the marker, written again, is trusted")
			require.Equal(t, 1, ledgerRowsAt(t, dbURL, before.ID))
		})
	}
}

// TestABackupRestoredOnANewTimelineIsANewHistory: a base backup of the
// cluster is restored and takes the cluster's place (same address, same
// system identifier), leaving recovery on a new timeline without an event
// committed after the backup, as a failover to a standby that had not
// received that commit does. The event, re-sent to the same guard while its
// done marker still lives in Redis, is applied once again.
func TestABackupRestoredOnANewTimelineIsANewHistory(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	dbURL := pg.URL()
	pool := migrated(t, dbURL)
	g, _, _ := redisRig(t, pool)
	ctx := context.Background()
	identity := func() (sysid int64, timeline string) {
		t.Helper()
		require.Eventually(t, func() bool {
			err := pool.QueryRow(ctx, `SELECT system_identifier, left(pg_walfile_name(pg_current_wal_lsn()), 8) FROM pg_control_system()`).Scan(&sysid, &timeline)
			return err == nil
		}, 30*time.Second, 20*time.Millisecond)
		return sysid, timeline
	}
	sysid, timeline := identity()

	before, after := event("evt_before", 1), event("evt_after", 1)
	require.Equal(t, guard.OutcomeProcessed, processAgain(t, g, before))
	backup, err := pg.BaseBackup()
	require.NoError(t, err)
	t.Cleanup(backup.Remove)
	require.Equal(t, guard.OutcomeProcessed, processAgain(t, g, after))
	require.Equal(t, guard.OutcomeDuplicateRedis, processAgain(t, g, after), "the marker is trusted before the failover")

	pg.Stop()
	backup.Port = pg.Port
	require.NoError(t, backup.Start())
	sysid2, timeline2 := identity()
	require.Equal(t, sysid, sysid2, "the premise: the same cluster")
	require.NotEqual(t, timeline, timeline2, "the premise: a new timeline")
	require.Equal(t, 0, ledgerRowsAt(t, dbURL, after.ID), "the premise: the commit after the backup is lost")

	require.Equal(t, guard.OutcomeProcessed, processAgain(t, g, after), "dropped on a marker of the timeline before")
	require.Equal(t, 1, ledgerRowsAt(t, dbURL, after.ID))
	require.Equal(t, guard.OutcomeDuplicatePostgres, processAgain(t, g, before))
	require.Equal(t, 1, ledgerRowsAt(t, dbURL, before.ID))
}
