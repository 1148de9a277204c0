package sandbox_test

import (
	"context"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
)

// CloseConnections must close the connections whose name has the prefix
// and leave every other connection alone: chaos runs share the broker.
func TestCloseConnectionsOnlyClosesThoseNamed(t *testing.T) {
	t.Parallel()
	if _, err := sandbox.CloseConnections("probe-", "probe"); err == sandbox.ErrNoRabbitmqctl {
		t.Skip(err)
	}
	prefix := testenv.Name(t) + "-victim-"
	dial := func(name string) *amqp.Connection {
		c, err := amqp.DialConfig(testenv.AMQPURL(), amqp.Config{Properties: amqp.Table{"connection_name": name}})
		require.NoError(t, err)
		t.Cleanup(func() { c.Close() })
		return c
	}
	victims := []*amqp.Connection{dial(prefix + "1"), dial(prefix + "2")}
	bystander := dial(testenv.Name(t) + "-bystander")
	// A connection still opening (its handshake not done) has no client
	// properties on the broker; a chaos run met one, and the close failed.
	u, err := url.Parse(testenv.AMQPURL())
	require.NoError(t, err)
	opening, err := net.Dial("tcp", u.Host)
	require.NoError(t, err)
	t.Cleanup(func() { opening.Close() })
	_, err = opening.Write([]byte("AMQP\x00\x00\x09\x01"))
	require.NoError(t, err)
	time.Sleep(200 * time.Millisecond)

	n, err := sandbox.CloseConnections(prefix, "sandbox test")
	require.NoError(t, err)
	require.Equal(t, 2, n)
	for _, v := range victims {
		require.Eventually(t, v.IsClosed, 5*time.Second, 10*time.Millisecond)
	}
	require.False(t, bystander.IsClosed(), "a connection without the prefix was closed")
	ch, err := bystander.Channel()
	require.NoError(t, err)
	ch.Close()
}

// A sandbox Redis can be paused, slowed and made to evict, and comes back.
func TestRedisFaults(t *testing.T) {
	t.Parallel()
	rs := testenv.StartRedis(t)
	rdb := rs.Client()
	defer rdb.Close()
	ctx := context.Background()

	require.NoError(t, rs.Pause(ctx, 300*time.Millisecond))
	start := time.Now()
	require.NoError(t, rdb.Ping(ctx).Err())
	require.Greater(t, time.Since(start), 200*time.Millisecond, "PING answered during CLIENT PAUSE")

	sctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	slowed := make(chan error, 1)
	go func() { slowed <- rs.Slow(sctx, 100*time.Millisecond) }()
	time.Sleep(50 * time.Millisecond)
	start = time.Now()
	require.NoError(t, rdb.Ping(ctx).Err())
	require.Greater(t, time.Since(start), 20*time.Millisecond, "PING answered at once while slowed")
	require.NoError(t, <-slowed)
	cancel()

	ectx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	evicted := make(chan error, 1)
	go func() { evicted <- rs.Evict(ectx, 1<<20, "allkeys-random") }()
	time.Sleep(100 * time.Millisecond)
	val := string(make([]byte, 1000))
	for i := range 5000 {
		require.NoError(t, rdb.Set(ctx, "k"+string(rune('a'+i%26))+time.Now().String(), val, 0).Err())
	}
	n, err := rdb.DBSize(ctx).Result()
	require.NoError(t, err)
	require.Less(t, n, int64(5000), "Redis with 1 MB of room kept 5 MB of keys")
	cancel()
	require.NoError(t, <-evicted)
	max, err := rdb.ConfigGet(ctx, "maxmemory").Result()
	require.NoError(t, err)
	require.Equal(t, "0", max["maxmemory"], "Evict must lift the cap when it ends")
}

// Through a DelayProxy, a Postgres round trip costs two delays more.
func TestDelayProxyAddsTheDelayEachWay(t *testing.T) {
	t.Parallel()
	u, err := url.Parse(testenv.DatabaseURL())
	require.NoError(t, err)
	p, err := sandbox.StartDelayProxy(u.Host, 5*time.Millisecond)
	require.NoError(t, err)
	defer p.Close()
	u.Host = p.Addr()
	ctx := context.Background()
	c, err := pgx.Connect(ctx, u.String())
	require.NoError(t, err)
	defer c.Close(ctx)
	var best time.Duration = time.Hour
	for range 5 {
		start := time.Now()
		require.NoError(t, c.QueryRow(ctx, "SELECT 1").Scan(new(int)))
		best = min(best, time.Since(start))
	}
	require.GreaterOrEqual(t, best, 10*time.Millisecond, "a round trip through the proxy must cost both delays")
	require.Less(t, best, 100*time.Millisecond)
}

// Connections counts, by node, the connections whose name matches: a
// chaos run's rabbit-kill picks the node that holds the most consumers by
// it, and a count that misses them makes it kill a node no consumer is on.
func TestClusterConnectionsCountsThoseNamedByNode(t *testing.T) {
	t.Parallel()
	if _, err := sandbox.CloseConnections("probe-", "probe"); err == sandbox.ErrNoRabbitmqctl {
		t.Skip(err)
	}
	mq, err := sandbox.StartRabbitCluster(1, 2*time.Minute)
	require.NoError(t, err)
	t.Cleanup(mq.Remove)
	prefix := testenv.Name(t) + "-"
	for _, name := range []string{prefix + "a", prefix + "b", "other"} {
		c, err := amqp.DialConfig(mq.Nodes[0].URL(), amqp.Config{Properties: amqp.Table{"connection_name": name}})
		require.NoError(t, err)
		t.Cleanup(func() { c.Close() })
	}
	by, err := mq.Connections(func(name string) bool { return strings.HasPrefix(name, prefix) })
	require.NoError(t, err)
	require.Equal(t, map[string]int{mq.Nodes[0].Name: 2}, by)
}
