package heartbeat_test

import (
	"context"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/heartbeat"
	"github.com/idemhq/idem/internal/testenv"
)

// TestAProcessReportsItselfAndGoesWhenItStops: a report's row carries the
// state, counts and per-second rates the process gives; it is refreshed on
// each beat, and deleted when the process stops cleanly.
func TestAProcessReportsItselfAndGoesWhenItStops(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t)
	require.NotEqual(t, heartbeat.Instance("c0"), heartbeat.Instance("c0"), "two services of one process")
	// A process killed a day and more ago left its row: the next reporter
	// to start deletes it.
	_, err := pool.Exec(context.Background(), `INSERT INTO idem_instance VALUES ('dead@h:1/000000', 'consumer', 'pay', 'q', 'v',
		now() - interval '3 days', now() - interval '2 days', 5000, true, '', '', '', '{}', '{}')`)
	require.NoError(t, err)
	var c heartbeat.Counter
	var tripped atomic.Value
	tripped.Store("")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		heartbeat.Run(ctx, pool, heartbeat.Instance("c0"), 200*time.Millisecond, func(context.Context) heartbeat.Report {
			on := tripped.Load().(string)
			return heartbeat.Report{Kind: "consumer", Scope: "pay", Queue: "q", Ready: on == "", TrippedOn: on,
				Why: map[bool]string{true: "", false: "consumer: failing: kill switch open"}[on == ""], Counts: c.Snapshot()}
		}, slog.Default())
	}()
	read := func() heartbeat.Report {
		t.Helper()
		rs, _, err := heartbeat.Read(context.Background(), pool)
		require.NoError(t, err)
		require.Len(t, rs, 1)
		return rs[0]
	}
	// The forgotten row goes before the first report is written.
	require.Eventually(t, func() bool {
		rs, _, err := heartbeat.Read(context.Background(), pool)
		return err == nil && len(rs) == 1 && strings.HasPrefix(rs[0].Instance, "c0@")
	}, 10*time.Second, 20*time.Millisecond)
	r := read()
	require.Regexp(t, `^c0@.+:\d+/[0-9a-f]{6}$`, r.Instance)
	require.True(t, r.Ready)
	require.Equal(t, 200*time.Millisecond, r.Every)

	for range 100 {
		c.Add("processed", 1)
	}
	c.Add("duplicate_redis", 5)
	tripped.Store("42P01")
	require.Eventually(t, func() bool { r = read(); return r.Counts["processed"] == 100 && r.TrippedOn == "42P01" },
		10*time.Second, 20*time.Millisecond)
	require.False(t, r.Ready)
	require.Equal(t, "consumer: failing: kill switch open", r.Why)
	require.Equal(t, int64(5), r.Counts["duplicate_redis"])
	require.Positive(t, r.Rates["processed"], "100 in the last interval")
	// Nothing more: the next beat's rate is 0.
	require.Eventually(t, func() bool { r = read(); return r.Rates["processed"] == 0 }, 10*time.Second, 20*time.Millisecond)
	seen := r.SeenAt
	require.Eventually(t, func() bool { return read().SeenAt.After(seen) }, 10*time.Second, 20*time.Millisecond, "refreshed")
	var now time.Time
	_, now, err = heartbeat.Read(context.Background(), pool)
	require.NoError(t, err)
	require.Zero(t, r.Silent(now), "on time")
	require.Positive(t, r.Silent(now.Add(time.Minute)), "a minute later, silent")

	cancel()
	<-done
	rs, _, err := heartbeat.Read(context.Background(), pool)
	require.NoError(t, err)
	require.Empty(t, rs, "a clean stop deletes the row, and the forgotten one went at the start")
}
