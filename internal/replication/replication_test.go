package replication_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/replication"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
)

// TestVerdicts: what each state says, and whether an acked event survives
// a failover.
func TestVerdicts(t *testing.T) {
	streaming := func(name, sync string) replication.Standby {
		return replication.Standby{Name: name, State: "streaming", SyncState: sync, Behind: 0}
	}
	hidden := replication.Standby{Behind: -1}
	for _, c := range []struct {
		name string
		st   replication.State
		ok   bool
		says string
	}{
		{"no standby", replication.State{SyncCommit: "on"}, true, "no standby: no failover can lose an acked event"},
		{"asynchronous", replication.State{SyncCommit: "on", Standbys: []replication.Standby{streaming("a", "async")}},
			false, "1 standby, none synchronous (synchronous_standby_names is empty): an acked event can be lost on failover"},
		{"synchronous", replication.State{SyncCommit: "on", SyncNames: "FIRST 1 (a, b)",
			Standbys: []replication.Standby{streaming("a", "sync"), streaming("b", "potential")}},
			true, "2 standbys, 1 synchronous (a): an acked event survives a failover to a synchronous standby"},
		{"quorum", replication.State{SyncCommit: "remote_apply", SyncNames: "ANY 1 (a, b)",
			Standbys: []replication.Standby{streaming("a", "quorum"), streaming("b", "quorum")}},
			true, "2 standbys, 2 synchronous (a, b)"},
		{"listed but absent", replication.State{SyncCommit: "on", SyncNames: "FIRST 1 (c)",
			Standbys: []replication.Standby{streaming("a", "async")}}, false, "commits wait until one is"},
		{"catching up", replication.State{SyncCommit: "on", SyncNames: "FIRST 1 (a)",
			Standbys: []replication.Standby{{Name: "a", State: "catchup", SyncState: "sync"}}}, false, "none synchronous now"},
		{"synchronous_commit local", replication.State{SyncCommit: "local", SyncNames: "FIRST 1 (a)",
			Standbys: []replication.Standby{streaming("a", "sync")}}, false, "synchronous_commit is local"},
		{"synchronous_commit off", replication.State{SyncCommit: "off"}, false, "a crash of the primary can lose an acked event"},
		{"a standby itself", replication.State{InRecovery: true, SyncCommit: "on"}, false, "this database is a standby"},
		{"hidden, none listed", replication.State{SyncCommit: "on", Hidden: true, Standbys: []replication.Standby{hidden}},
			false, "none synchronous (synchronous_standby_names is empty)"},
		{"hidden, some listed", replication.State{SyncCommit: "on", Hidden: true, SyncNames: "a", Standbys: []replication.Standby{hidden}},
			true, "this role cannot see which standby is synchronous (grant it pg_monitor)"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ok, text := c.st.Verdict()
			require.Equal(t, c.ok, ok, text)
			require.Contains(t, text, c.says)
		})
	}
}

// TestReadOnTheSharedServer: the shared server has no standby.
func TestReadOnTheSharedServer(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), testenv.DatabaseURL())
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	st, err := replication.Read(context.Background(), pool)
	require.NoError(t, err)
	require.False(t, st.InRecovery)
	require.NotEmpty(t, st.SyncCommit)
	ok, text := st.Verdict()
	t.Logf("shared server: %s", text)
	if len(st.Standbys) == 0 {
		require.True(t, ok)
	}
}

// TestAWatcherSaysWhatAFailoverWouldLose: a primary with an asynchronous
// standby is a warning, logged once however often it is read, and in the
// metrics; made synchronous, the standby is an OK, logged once; a role
// without pg_monitor sees the standby but not its state, and says so; the
// standby itself says it is one.
func TestAWatcherSaysWhatAFailoverWouldLose(t *testing.T) {
	t.Parallel()
	p := testenv.StartPair(t, sandbox.PairConfig{})
	ctx := context.Background()
	primary, err := pgxpool.New(ctx, p.Primary.URL())
	require.NoError(t, err)
	t.Cleanup(primary.Close)
	var logs testenv.LogBuffer
	w := replication.NewWatcher([]replication.Querier{primary}, slog.New(slog.NewTextHandler(&logs, nil)))
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(w.Collector()))

	_, err = w.Check()
	require.ErrorContains(t, err, "not read yet")
	require.Zero(t, series(t, reg, ""), "no series before the first reading")

	w.Read(ctx)
	w.Read(ctx)
	_, err = w.Check()
	require.ErrorContains(t, err, "1 standby, none synchronous (synchronous_standby_names is empty): an acked event can be lost on failover")
	require.Equal(t, 1, strings.Count(logs.String(), "level=WARN"), "one warning for two readings:\n%s", logs.String())
	require.Equal(t, 1.0, gauge(t, reg, "idem_postgres_standbys"))
	require.Equal(t, 0.0, gauge(t, reg, "idem_postgres_sync_standbys"))
	// A standby reports its position once it has received WAL.
	_, err = primary.Exec(ctx, `CREATE TABLE wal ()`)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		w.Read(ctx)
		return series(t, reg, "idem_postgres_standby_behind_bytes") == 1
	}, 10*time.Second, 50*time.Millisecond, "how far the standby trails")

	_, err = primary.Exec(ctx, `ALTER SYSTEM SET synchronous_standby_names = 'FIRST 1 (`+sandbox.StandbyName+`)'`)
	require.NoError(t, err)
	_, err = primary.Exec(ctx, `SELECT pg_reload_conf()`)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		w.Read(ctx)
		_, err := w.Check()
		return err == nil
	}, 10*time.Second, 50*time.Millisecond)
	detail, _ := w.Check()
	require.Equal(t, "1 standby, 1 synchronous ("+sandbox.StandbyName+"): an acked event survives a failover to a synchronous standby", detail)
	require.Equal(t, 1, strings.Count(logs.String(), "level=INFO"), logs.String())
	require.Equal(t, 1.0, gauge(t, reg, "idem_postgres_sync_standbys"))

	// A role without pg_monitor.
	_, err = primary.Exec(ctx, `CREATE ROLE watcher LOGIN`)
	require.NoError(t, err)
	plain, err := pgx.Connect(ctx, strings.Replace(p.Primary.URL(), "postgres@", "watcher@", 1))
	require.NoError(t, err)
	defer plain.Close(ctx)
	st, err := replication.Read(ctx, plain)
	require.NoError(t, err)
	require.True(t, st.Hidden)
	require.Len(t, st.Standbys, 1)
	_, text := st.Verdict()
	require.Contains(t, text, "cannot see which standby is synchronous (grant it pg_monitor)")
	_, err = primary.Exec(ctx, `GRANT pg_monitor TO watcher`)
	require.NoError(t, err)
	st, err = replication.Read(ctx, plain)
	require.NoError(t, err)
	require.False(t, st.Hidden, "pg_monitor sees it all")
	require.Equal(t, 1, st.Synchronous())

	standby, err := pgx.Connect(ctx, p.Standby.URL())
	require.NoError(t, err)
	defer standby.Close(ctx)
	st, err = replication.Read(ctx, standby)
	require.NoError(t, err)
	ok, text := st.Verdict()
	require.False(t, ok)
	require.Contains(t, text, "this database is a standby")
}

// series counts the series of name, or of every metric if name is empty.
func series(t *testing.T, reg *prometheus.Registry, name string) int {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	n := 0
	for _, f := range families {
		if name == "" || f.GetName() == name {
			n += len(f.GetMetric())
		}
	}
	return n
}

// gauge is the value of name's one series, labelled shard 0.
func gauge(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() == name {
			require.Len(t, f.GetMetric(), 1)
			m := f.GetMetric()[0]
			require.Equal(t, "0", m.GetLabel()[0].GetValue())
			return m.GetGauge().GetValue()
		}
	}
	t.Fatalf("no %s", name)
	return 0
}
