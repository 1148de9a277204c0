package redistier_test

import (
	"context"
	"fmt"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/config"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/guardtest"
	"github.com/idemhq/idem/pkg/guard/redistier"
)

// startCluster starts a test-owned Redis Cluster: three masters, one replica each.
func startCluster(t *testing.T) *sandbox.RedisCluster {
	t.Helper()
	c, err := sandbox.StartRedisCluster(t.TempDir(), 3)
	require.NoError(t, err)
	t.Cleanup(c.Kill)
	return c
}

// TestFastPathOnRedisCluster runs the fast-path suite on a real cluster:
// claims, done markers and releases of one call span every master.
func TestFastPathOnRedisCluster(t *testing.T) {
	t.Parallel()
	c := startCluster(t)
	rdb := c.Client()
	t.Cleanup(func() { rdb.Close() })
	guardtest.TestFastPath(t, func(t *testing.T) guard.FastPath {
		f, err := redistier.New(rdb, redistier.Config{Timeout: time.Second})
		require.NoError(t, err)
		return f
	})
}

// TestEveryClientTypeMustKeepDeadlines refuses a cluster, failover or ring
// client that would ignore the per-call deadline.
func TestEveryClientTypeMustKeepDeadlines(t *testing.T) {
	for _, rdb := range []redis.UniversalClient{
		redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}),
		redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{"127.0.0.1:1"}}),
		redis.NewFailoverClient(&redis.FailoverOptions{MasterName: "m", SentinelAddrs: []string{"127.0.0.1:1"}}),
		redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": "127.0.0.1:1"}}),
	} {
		_, err := redistier.New(rdb, redistier.Config{})
		require.ErrorContains(t, err, "ContextTimeoutEnabled", "%T", rdb)
		rdb.Close()
	}
}

// TestStoppedClusterNodeCostsOneDeadline freezes one master (SIGSTOP: its
// sockets stay open and silent): a claim of keys on every master must end
// within its deadline, the stopped master's keys skipped, not wait for the
// client's read timeout.
func TestStoppedClusterNodeCostsOneDeadline(t *testing.T) {
	t.Parallel()
	c := startCluster(t)
	rdb := c.Client()
	t.Cleanup(func() { rdb.Close() })
	const timeout = 50 * time.Millisecond
	f, err := redistier.New(rdb, redistier.Config{Prefix: "stop", Timeout: timeout})
	require.NoError(t, err)
	events := make([]guard.Event, 64)
	for i := range events {
		events[i] = guard.Event{ID: fmt.Sprintf("evt_%d", i), Hash: guard.HashFields("x")}
	}
	ctx := context.Background()
	for _, r := range f.Claim(ctx, "svc", "", events) {
		require.Equal(t, tier.FastAcquired, r.State, "%v", r.Err)
	}

	m := c.Masters(ctx)[0]
	require.NoError(t, m.Signal(syscall.SIGSTOP))
	t.Cleanup(func() { _ = m.Signal(syscall.SIGCONT) })
	for range 3 {
		began := time.Now()
		res := f.Claim(ctx, "svc", "", events)
		took := time.Since(began)
		require.Less(t, took, 10*timeout, "a claim with a stopped node took %s against a %s deadline", took, timeout)
		// The stopped master's keys are skipped (the store decides them);
		// the others hold their first claim's leases.
		skipped := 0
		for _, r := range res {
			if r.State == tier.FastSkipped {
				require.Error(t, r.Err)
				skipped++
				continue
			}
			require.Equal(t, tier.FastPending, r.State)
		}
		require.Positive(t, skipped)
	}
}

// TestClusterFailoverResumesTheFastTier kills a master under a client built
// as idem consume builds it (redis.mode cluster): claims fail within their
// deadline while the master is gone, and succeed again on every slot once
// its replica is promoted.
func TestClusterFailoverResumesTheFastTier(t *testing.T) {
	t.Parallel()
	c := startCluster(t)
	f := failoverFilter(t, "cluster", c.URL())
	ctx := context.Background()
	batch := func(i int) []guard.Event {
		events := make([]guard.Event, 32) // on every master
		for k := range events {
			events[k] = guard.Event{ID: fmt.Sprintf("evt_%d_%d", i, k), Hash: guard.HashFields("x")}
		}
		return events
	}
	c.Masters(ctx)[0].Kill()
	took, failed := requireResumes(t, func(i int) []tier.FastResult { return f.Claim(ctx, "svc", "", batch(i)) })
	require.Len(t, c.Masters(ctx), 3, "a replica took over")
	t.Logf("resumed %s after the kill, %d claims failed meanwhile", took.Round(time.Millisecond), failed)
}

// failoverTimeout is the per-call deadline of the failover tests' filters.
const failoverTimeout = 50 * time.Millisecond

// failoverFilter is a Filter over a client built as idem consume builds it
// for redis.mode mode, with a breaker that never opens, so that every claim
// reaches Redis.
func failoverFilter(t *testing.T, mode, url string) *redistier.Filter {
	t.Helper()
	cfg := config.Default()
	cfg.Redis.Mode, cfg.RedisURL = mode, url
	rdb, err := cfg.RedisClient()
	require.NoError(t, err)
	t.Cleanup(func() { rdb.Close() })
	f, err := redistier.New(rdb, redistier.Config{Timeout: failoverTimeout, Breaker: redistier.BreakerConfig{FailureThreshold: 1 << 30}})
	require.NoError(t, err)
	return f
}

// requireResumes claims (claim(i), i = 0, 1, …) after a master was killed
// until a claim succeeds, requiring each to end within its deadline, at
// least one to fail, and the fast tier to resume within 30 s. It returns how
// long that took and how many claims failed.
func requireResumes(t *testing.T, claim func(i int) []tier.FastResult) (time.Duration, int) {
	t.Helper()
	const deadline = failoverTimeout
	killed := time.Now()
	failed := 0
	for i := 0; ; i++ {
		began := time.Now()
		res := claim(i)
		require.Less(t, time.Since(began), 10*deadline, "a claim outlived its deadline")
		// A claim may fail for the dead master's keys only: it has
		// resumed when every key answers.
		if !slices.ContainsFunc(res, func(r tier.FastResult) bool { return r.Err != nil }) {
			for _, r := range res {
				require.Equal(t, tier.FastAcquired, r.State)
			}
			break
		}
		failed++
		require.Less(t, time.Since(killed), 30*time.Second, "the fast tier never resumed after the failover")
		time.Sleep(20 * time.Millisecond)
	}
	require.Positive(t, failed, "the master's loss went unnoticed")
	return time.Since(killed), failed
}
