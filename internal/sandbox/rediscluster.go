package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisCluster is a Redis Cluster of the caller's own: masters with one
// replica each, every node a redis-server on its own free port, so that a
// test or a chaos run can kill a master and watch its replica take over.
type RedisCluster struct {
	Nodes []*Redis
}

// clusterNodeTimeout is how long a master may be unreachable before its
// replica is promoted: short, so a failover takes a second or two.
const clusterNodeTimeout = 1000 * time.Millisecond

// StartRedisCluster starts masters×2 nodes under dir and joins them into a
// cluster with one replica per master (redis-cli --cluster create), then
// waits until every node reports the cluster ok.
func StartRedisCluster(dir string, masters int) (*RedisCluster, error) {
	if _, err := exec.LookPath("redis-cli"); err != nil {
		return nil, fmt.Errorf("sandbox: redis-cli not installed: %w", err)
	}
	c := &RedisCluster{}
	var addrs []string
	for i := range 2 * masters {
		ndir := filepath.Join(dir, fmt.Sprintf("node%d", i))
		if err := os.MkdirAll(ndir, 0o755); err != nil {
			return nil, fmt.Errorf("sandbox: %w", err)
		}
		port, err := FreePort()
		if err != nil {
			c.Kill()
			return nil, err
		}
		n := &Redis{Port: port, dir: ndir, Args: []string{
			"--cluster-enabled", "yes", "--cluster-config-file", filepath.Join(ndir, "nodes.conf"),
			"--cluster-node-timeout", strconv.Itoa(int(clusterNodeTimeout.Milliseconds())),
			// A replica of a master that was down takes over at once.
			"--cluster-replica-validity-factor", "0",
		}}
		if err := n.Start(); err != nil {
			c.Kill()
			return nil, err
		}
		c.Nodes = append(c.Nodes, n)
		addrs = append(addrs, fmt.Sprintf("127.0.0.1:%d", port))
	}
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "1", "--cluster-yes")
	if out, err := exec.Command("redis-cli", args...).CombinedOutput(); err != nil {
		c.Kill()
		return nil, fmt.Errorf("sandbox: redis-cli --cluster create: %v\n%s", err, out)
	}
	if err := c.WaitHealthy(30 * time.Second); err != nil {
		c.Kill()
		return nil, err
	}
	return c, nil
}

// URL is a REDIS_URL for redis.mode cluster: the first node, and every other
// node as an addr parameter (go-redis's cluster URL syntax).
func (c *RedisCluster) URL() string {
	var b strings.Builder
	fmt.Fprintf(&b, "redis://127.0.0.1:%d", c.Nodes[0].Port)
	for i, n := range c.Nodes[1:] {
		sep := "&"
		if i == 0 {
			sep = "?"
		}
		fmt.Fprintf(&b, "%saddr=127.0.0.1:%d", sep, n.Port)
	}
	return b.String()
}

// Client returns a new cluster client with per-call deadlines on.
func (c *RedisCluster) Client() *redis.ClusterClient {
	var addrs []string
	for _, n := range c.Nodes {
		addrs = append(addrs, fmt.Sprintf("127.0.0.1:%d", n.Port))
	}
	return redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, ContextTimeoutEnabled: true})
}

// Masters returns the nodes that are masters now, by asking each live node
// for its role.
func (c *RedisCluster) Masters(ctx context.Context) []*Redis {
	var out []*Redis
	for _, n := range c.Nodes {
		if role, err := n.role(ctx); err == nil && role == "master" {
			out = append(out, n)
		}
	}
	return out
}

// WaitHealthy waits until every live node reports cluster_state:ok and
// every slot is served by a master that answers.
func (c *RedisCluster) WaitHealthy(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last error
	for time.Now().Before(deadline) {
		if last = c.healthy(); last == nil {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("sandbox: redis cluster not healthy within %s: %w", timeout, last)
}

func (c *RedisCluster) healthy() error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	for _, n := range c.Nodes {
		if !n.alive() {
			continue
		}
		rdb := n.Client()
		info, err := rdb.ClusterInfo(ctx).Result()
		rdb.Close()
		if err != nil {
			return fmt.Errorf("node %d: %w", n.Port, err)
		}
		if !strings.Contains(info, "cluster_state:ok") || !strings.Contains(info, "cluster_slots_ok:16384") {
			return fmt.Errorf("node %d: cluster not ok", n.Port)
		}
	}
	// Every master the client maps a slot to must answer.
	rdb := c.Client()
	defer rdb.Close()
	return rdb.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error { return m.Ping(ctx).Err() })
}

// Kill SIGKILLs every node.
func (c *RedisCluster) Kill() {
	for _, n := range c.Nodes {
		n.Kill()
	}
}

func (s *Redis) role(ctx context.Context) (string, error) {
	if !s.alive() {
		return "", errors.New("not running")
	}
	rdb := s.Client()
	defer rdb.Close()
	info, err := rdb.Info(ctx, "replication").Result()
	if err != nil {
		return "", err
	}
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "role:"); ok {
			return v, nil
		}
	}
	return "", errors.New("no role in INFO replication")
}

// alive reports whether the server process runs.
func (s *Redis) alive() bool {
	if s.done == nil {
		return false
	}
	select {
	case <-s.done:
		return false
	default:
		return true
	}
}
