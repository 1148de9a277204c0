package chaos

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/fleet"
	"github.com/idemhq/idem/internal/loadgen"
	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/verify"
	"github.com/idemhq/idem/pkg/partition"
)

// clusterEnv is a test's fleet on distributed tiers: a Redis Cluster, a
// RabbitMQ cluster with partitioned queues, and Postgres shards.
type clusterEnv struct {
	*env
	redis      *sandbox.RedisCluster
	rabbit     *sandbox.RabbitCluster
	shard1     *testenv.PostgresServer
	shards     []*pgxpool.Pool
	partitions int
}

// newClusterEnv starts the three tiers at once (the RabbitMQ nodes take the
// longest to boot) and a test schema on each of two shards: shard 0 on the
// shared PostgreSQL, shard 1 on a test-owned server the test can restart.
func newClusterEnv(t *testing.T, partitions int) *clusterEnv {
	t.Helper()
	rabbit := sandbox.StartRabbitClusterAsync(3, 2*time.Minute)
	rc := testenv.StartRedisCluster(t)
	pg1 := testenv.StartPostgres(t)
	mq, err := rabbit()
	if mq != nil {
		t.Cleanup(mq.Remove)
	}
	if err != nil && strings.Contains(err.Error(), "not installed") {
		t.Skip(err)
	}
	require.NoError(t, err)

	e := newEnvOn(t, rc.URL(), mq.Nodes[0].URL(), testenv.DatabaseURL())
	pool1, url1 := testenv.SchemaOn(t, pg1.URL(), payments.Migrations)
	url1 = testenv.WithParam(url1, "application_name", e.appName)
	var url0 string
	for _, v := range e.vars {
		if u, ok := strings.CutPrefix(v, "DATABASE_URL="); ok {
			url0 = u
		}
	}
	e.vars = append(e.vars,
		"IDEM_REDIS_MODE=cluster",
		"IDEM_POSTGRES_SHARDS="+url0+" "+url1,
		fmt.Sprintf("IDEM_PARTITIONS=%d", partitions),
		"AMQP_URL="+mq.URLs(),
	)
	return &clusterEnv{env: e, redis: rc, rabbit: mq, shard1: pg1, shards: []*pgxpool.Pool{e.pool, pool1}, partitions: partitions}
}

// consumeOn starts a consumer whose broker list starts at node first, taking
// the partitions given (all if none).
func (c *clusterEnv) consumeOn(name string, first int, partitions string) *fleet.Proc {
	c.t.Helper()
	nodes := c.rabbit.Nodes
	var urls []string
	for k := range nodes {
		urls = append(urls, nodes[(first+k)%len(nodes)].URL())
	}
	var args []string
	if partitions != "" {
		args = []string{"--partition", partitions}
	}
	p, err := fleet.Start(fleet.Spec{Bin: idemBin, Name: name, Dir: c.dir, Args: args,
		Env: append(append([]string{}, c.vars...), "AMQP_URL="+strings.Join(urls, ","))})
	require.NoError(c.t, err)
	c.procs = append(c.procs, p)
	return p
}

// rows counts ledger rows on every shard.
func (c *clusterEnv) rows() int {
	n := 0
	for _, p := range c.shards {
		var k int
		if err := p.QueryRow(context.Background(), `SELECT count(*) FROM payments_ledger`).Scan(&k); err == nil {
			n += k
		}
	}
	return n
}

func (c *clusterEnv) waitRows(n int) {
	c.t.Helper()
	require.Eventually(c.t, func() bool { return c.rows() >= n }, 90*time.Second, 20*time.Millisecond, "the ledgers never reached %d rows", n)
}

// queued returns the ready messages in every partition queue and the
// dead-letter queue, asked of a node that runs.
func (c *clusterEnv) queued() (work, dead int) {
	c.t.Helper()
	for _, n := range c.rabbit.Nodes {
		if !n.Running() {
			continue
		}
		for _, q := range (broker.Topology{Queue: c.queue, Partitions: c.partitions}).Queues() {
			k, err := sandbox.ReadyMessages(n.URL(), q)
			require.NoError(c.t, err)
			work += k
		}
		k, err := sandbox.ReadyMessages(n.URL(), c.queue+".dlq")
		require.NoError(c.t, err)
		return work, k
	}
	c.t.Fatal("no RabbitMQ node runs")
	return 0, 0
}

// totals sums the consumers' stats files.
func (c *clusterEnv) totals() map[string]int64 {
	out := map[string]int64{}
	for _, p := range c.procs {
		st, err := p.Stats()
		require.NoError(c.t, err, "%s (exited: %v)", p.Name, p.Err())
		for k, v := range st {
			out[k] += v
		}
	}
	return out
}

// TestFleetOnClusters runs a fleet of four consumers on a real Redis Cluster
// (three masters, one replica each), a real three-node RabbitMQ cluster with
// four partition queues, and two Postgres shards, while a stream with
// duplicates flows: a Redis master is killed, the RabbitMQ node that leads a
// partition queue is killed, shard 1's server is restarted and shard 0's
// sessions are terminated. Every event must end applied exactly once, on the
// shard of its user, with nothing left in any queue; the breaker must open
// and close; and a replay of the whole stream afterwards must be dropped
// mostly by the new Redis masters.
//
// It is not parallel: three RabbitMQ nodes and six Redis servers booting
// on two cores would slow every test beside them. Go runs it before the
// parallel tests, and it holds the machine from test/e2e's tests
// (testenv.Exclusive): its replay's share dropped by Redis needs the
// breaker to stay closed, which a loaded machine's Redis timeouts open.
func TestFleetOnClusters(t *testing.T) {
	testenv.Exclusive(t)
	c := newClusterEnv(t, 4)
	consumers := []*fleet.Proc{
		c.consumeOn("c0", 0, ""),    // every partition
		c.consumeOn("c1", 1, ""),    // every partition, another node first
		c.consumeOn("c2", 2, "0,2"), // the partitions of shard 0
		c.consumeOn("c3", 0, "1,3"), // the partitions of shard 1
	}
	for _, p := range consumers {
		c.waitConsuming(p)
	}
	leader, err := c.rabbit.Leader(c.queue + ".0")
	require.NoError(t, err)
	var publishTo *sandbox.RabbitNode
	for _, n := range c.rabbit.Nodes {
		if n != leader {
			publishTo = n
		}
	}
	manifest := filepath.Join(c.dir, "manifest-0.json")
	publishArgs := []string{"publish", "--quiet", "--count", "4000", "--users", "40", "--dup-ratio", "0.25",
		"--delay-window", "200", "--rate", "500", "--seed", "7", "--manifest", manifest}
	published := make(chan result, 1)
	go func() { published <- c.run([]string{"AMQP_URL=" + publishTo.URL()}, publishArgs...) }()

	c.waitRows(400)
	masters := c.redis.Masters(context.Background())
	require.Len(t, masters, 3)
	masters[0].Kill()
	t.Logf("killed redis master :%d at %d rows", masters[0].Port, c.rows())
	c.waitRows(c.rows() + 400)

	leader.Kill()
	t.Logf("killed rabbitmq node %s (leader of %s.0) at %d rows", leader.Name, c.queue, c.rows())
	c.waitRows(c.rows() + 400)

	t.Logf("stopping shard 1 at %d rows", c.rows())
	c.shard1.Stop()
	c.shard1.Start()
	c.waitRows(c.rows() + 300)
	_, err = c.pool.Exec(context.Background(), `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1`, c.appName)
	require.NoError(t, err)

	pub := <-published
	require.Zero(t, pub.code, pub.out)
	m, err := loadgen.ReadManifest(manifest)
	require.NoError(t, err)
	r, err := verify.WaitShards(context.Background(), c.shards, m, 2*time.Minute)
	require.NoError(t, err)
	require.True(t, r.OK(), "%+v", r)
	require.Equal(t, len(m.Events), r.ExactlyOnce)
	require.Zero(t, r.Misrouted, "every row on its user's shard")
	for i, p := range c.shards {
		var n int
		require.NoError(t, p.QueryRow(context.Background(), `SELECT count(*) FROM idem_processed`).Scan(&n))
		require.Positive(t, n, "shard %d holds dedup rows", i)
	}
	require.Eventually(t, func() bool { w, _ := c.queued(); return w == 0 }, time.Minute, 50*time.Millisecond, "partition queues never emptied")
	time.Sleep(1500 * time.Millisecond) // the stats files are written every second
	before := c.totals()
	require.Positive(t, before["breaker/closed->open"], "the master's loss must open the breaker: %v", before)
	require.Positive(t, before["breaker/half-open->closed"], "the breaker must close on the new master: %v", before)
	require.Positive(t, before["count/reconnects"], "the consumers on the lost node must reconnect: %v", before)

	// The fast tier resumed: the same stream again is dropped by Redis,
	// not Postgres, for most events, and none is applied again.
	pub = c.run([]string{"AMQP_URL=" + publishTo.URL()}, publishArgs...)
	require.Zero(t, pub.code, pub.out)
	require.Eventually(t, func() bool { w, _ := c.queued(); return w == 0 }, time.Minute, 50*time.Millisecond, "partition queues never emptied")
	for _, p := range consumers {
		require.NoError(t, p.Stop(30*time.Second), "%s must drain and exit 0", p.Name)
	}
	after := c.totals()
	// At most once each by the consumers' count. Fewer is not a loss: a
	// COMMIT whose answer the stopped shard never sent is of unknown
	// outcome, so its event's next copy is counted as a duplicate even
	// when the commit landed; CheckShards below says each applied once.
	require.LessOrEqual(t, after["processed"], int64(len(m.Events)), "nothing applied twice: %v", after)
	again := after["duplicate_redis"] - before["duplicate_redis"]
	require.Greater(t, again, int64(m.Messages/2), "the replayed stream must be dropped mostly by Redis: %v", after)
	work, dead := c.queued()
	require.Zero(t, work, "messages stuck in the partition queues")
	require.Zero(t, dead, "dead letters")
	r, err = verify.CheckShards(context.Background(), c.shards, m)
	require.NoError(t, err)
	require.True(t, r.OK(), "%+v", r)

	// The operator's tools see every shard.
	out, err := c.idem("verify", "--manifest", manifest)
	require.NoError(t, err, out)
	require.Contains(t, out, "PASS")
	require.Regexp(t, `shards\s+2`, out)
	require.Regexp(t, `misrouted rows\s+0`, out)
	out, err = c.idem("migrate")
	require.NoError(t, err, out)
	require.Contains(t, out, "shard 0 is up to date")
	require.Contains(t, out, "shard 1 is up to date")
	out, err = c.idem("prune")
	require.NoError(t, err, out)
	require.Contains(t, out, "shard 1: pruned 0 dedup rows")
	ev := m.Events[len(m.Events)/2]
	out, err = c.idem("inspect", ev.EventID)
	require.NoError(t, err, out)
	require.Contains(t, out, fmt.Sprintf("(shard %d)", partition.Of(ev.UserID, 2)))
	require.Regexp(t, `verdict:\s+processed once`, out)
}
