package e2e

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/loadgen"
	"github.com/idemhq/idem/internal/testenv"
)

// ledgerRows counts all ledger rows of the test's schema.
func (e *env) ledgerRows() int {
	var n int
	require.NoError(e.t, e.pool.QueryRow(context.Background(), `SELECT count(*) FROM payments_ledger`).Scan(&n))
	return n
}

// waitRows waits until the ledger has at least n rows.
func (e *env) waitRows(n int) {
	e.t.Helper()
	require.Eventually(e.t, func() bool { return e.ledgerRows() >= n }, 60*time.Second, 10*time.Millisecond,
		"ledger never reached %d rows", n)
}

// publishAsync runs a rate-limited publish in the background.
func (e *env) publishAsync(count int, dup float64, rate int) <-chan loadgen.Manifest {
	out := make(chan loadgen.Manifest, 1)
	go func() { out <- e.publish(count, dup, "--rate", fmt.Sprint(rate)) }()
	return out
}

// twoConsumersOnOwnRedis starts a test-owned redis-server and two consumers
// using it.
func twoConsumersOnOwnRedis(t *testing.T) (*testenv.RedisServer, *env) {
	t.Helper()
	rs := testenv.StartRedis(t)
	e := newEnv(t, rs.URL(), "")
	e.consume("c0")
	e.consume("c1")
	return rs, e
}

// TestRedisKilledAndFlushedMidStream runs two consumers on a test-owned Redis
// and kills it, restarts it and flushes it while events flow. The ledger must
// end exactly as with a healthy Redis; only the cost moves to Postgres.
func TestRedisKilledAndFlushedMidStream(t *testing.T) {
	t.Parallel()
	rs, e := twoConsumersOnOwnRedis(t)
	published := e.publishAsync(3000, 0.25, 1200)

	e.waitRows(400)
	rs.Kill()
	down := e.ledgerRows()
	e.waitRows(down + 400) // processing goes on without Redis
	rs.Start()
	e.waitRows(e.ledgerRows() + 400)
	rdb := rs.Client()
	require.NoError(t, rdb.FlushAll(context.Background()).Err())
	rdb.Close()

	m := <-published
	r := e.waitApplied(m)
	require.True(t, r.OK(), "%+v", r)
	stats := e.stopAll()
	require.Positive(t, stats["breaker/closed->open"], "the outage must have opened the breaker: %v", stats)
	require.Positive(t, stats["duplicate_postgres"], "duplicates during the outage are caught by Postgres: %v", stats)
	e.requireExactlyOnce(m)
}

// TestRedisFlushedRepeatedly flushes the shared-nothing Redis over and over:
// every done marker and lease vanishes, as under eviction.
func TestRedisFlushedRepeatedly(t *testing.T) {
	t.Parallel()
	rs, e := twoConsumersOnOwnRedis(t)
	published := e.publishAsync(2000, 0.5, 1500)
	rdb := rs.Client()
	defer rdb.Close()
	for i := 1; i <= 5; i++ {
		e.waitRows(i * 250)
		require.NoError(t, rdb.FlushAll(context.Background()).Err())
	}
	m := <-published
	e.waitApplied(m)
	e.stopAll()
	e.requireExactlyOnce(m)
}

// TestRedisEvictingUnderMemoryPressure runs the stream on a full Redis with
// an evicting policy, so leases and done markers vanish at random while
// consumers rely on them.
func TestRedisEvictingUnderMemoryPressure(t *testing.T) {
	t.Parallel()
	rs := testenv.StartRedis(t)
	rdb := rs.Client()
	defer rdb.Close()
	ctx := context.Background()
	// Fill Redis, then cap it at what it uses now: from here on every
	// write evicts random keys, ours among them.
	pipe := rdb.Pipeline()
	for i := range 30000 {
		pipe.Set(ctx, fmt.Sprintf("filler:%d", i), strings.Repeat("x", 64), 0)
	}
	_, err := pipe.Exec(ctx)
	require.NoError(t, err)
	info, err := rdb.InfoMap(ctx, "memory").Result()
	require.NoError(t, err)
	require.NoError(t, rdb.ConfigSet(ctx, "maxmemory-policy", "allkeys-random").Err())
	require.NoError(t, rdb.ConfigSet(ctx, "maxmemory", info["Memory"]["used_memory"]).Err())

	e := newEnv(t, rs.URL(), "")
	e.consume("c0")
	e.consume("c1")
	m := e.publish(3000, 0.5)
	e.waitApplied(m)
	e.stopAll()
	e.requireExactlyOnce(m)
	stats, err := rdb.InfoMap(ctx, "stats").Result()
	require.NoError(t, err)
	evicted, _ := strconv.Atoi(stats["Stats"]["evicted_keys"])
	require.Positive(t, evicted, "the memory limit must actually have evicted keys")
	t.Logf("redis evicted %d keys", evicted)
}
