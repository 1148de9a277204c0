package sandbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// RabbitCluster is a RabbitMQ cluster of the caller's own: nodes on this
// machine, each with its own ports, config file, data directory and node
// name, run as the rabbitmq user (so that they share the local node's
// Erlang cookie and can be driven by rabbitmqctl). A test or chaos run can
// stop the node that leads a quorum queue and start it again.
type RabbitCluster struct {
	Nodes []*RabbitNode
	dir   string
}

// RabbitNode is one node of a RabbitCluster.
type RabbitNode struct {
	Name     string // Erlang node name, e.g. idem-1a2b-0@localhost
	Port     int    // AMQP port
	DistPort int    // Erlang distribution port
	dir      string
	cmd      *exec.Cmd
	done     chan struct{}
}

// rabbitServer is the Debian package's start script; as root it is run as
// the rabbitmq user.
const rabbitServer = "/usr/lib/rabbitmq/bin/rabbitmq-server"

// StartRabbitCluster starts n nodes that find each other through classic
// peer discovery, and waits until each runs and sees the others.
func StartRabbitCluster(n int, timeout time.Duration) (*RabbitCluster, error) {
	if _, err := os.Stat(rabbitServer); err != nil {
		return nil, fmt.Errorf("sandbox: rabbitmq-server not installed: %w", err)
	}
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		return nil, ErrNoRabbitmqctl
	}
	// Under /tmp, not a test's 0700 temp dir: the rabbitmq user must reach it.
	dir, err := os.MkdirTemp("", "idem-rabbit-")
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	c := &RabbitCluster{dir: dir}
	var id [3]byte
	_, _ = rand.Read(id[:])
	prefix := "idem-" + hex.EncodeToString(id[:])
	for i := range n {
		port, err1 := FreePort()
		dist, err2 := FreePort()
		if err := errors.Join(err1, err2); err != nil {
			c.Remove()
			return nil, err
		}
		c.Nodes = append(c.Nodes, &RabbitNode{Name: fmt.Sprintf("%s-%d@localhost", prefix, i), Port: port, DistPort: dist,
			dir: filepath.Join(dir, strconv.Itoa(i))})
	}
	for _, node := range c.Nodes {
		if err := node.writeConfig(c.Nodes); err != nil {
			c.Remove()
			return nil, err
		}
	}
	if err := chownRabbit(dir); err != nil {
		c.Remove()
		return nil, err
	}
	for _, node := range c.Nodes {
		if err := node.launch(); err != nil {
			c.Remove()
			return nil, err
		}
	}
	if err := c.WaitFormed(timeout); err != nil {
		c.Remove()
		return nil, err
	}
	return c, nil
}

// StartRabbitClusterAsync starts StartRabbitCluster in the background, so
// that other services can start meanwhile (its nodes take the longest to
// boot); wait returns what StartRabbitCluster returned.
func StartRabbitClusterAsync(n int, timeout time.Duration) (wait func() (*RabbitCluster, error)) {
	type started struct {
		c   *RabbitCluster
		err error
	}
	done := make(chan started, 1)
	go func() {
		c, err := StartRabbitCluster(n, timeout)
		done <- started{c, err}
	}()
	return func() (*RabbitCluster, error) {
		s := <-done
		return s.c, s.err
	}
}

func (n *RabbitNode) writeConfig(all []*RabbitNode) error {
	if err := os.MkdirAll(n.dir, 0o755); err != nil {
		return fmt.Errorf("sandbox: %w", err)
	}
	var conf strings.Builder
	fmt.Fprintf(&conf, "listeners.tcp.local = 127.0.0.1:%d\n", n.Port)
	conf.WriteString("cluster_formation.peer_discovery_backend = classic_config\n")
	for i, o := range all {
		fmt.Fprintf(&conf, "cluster_formation.classic_config.nodes.%d = %s\n", i+1, o.Name)
	}
	// Short waits, so that a stopped node is noticed in seconds.
	conf.WriteString("heartbeat = 5\n")
	files := map[string]string{
		"rabbitmq.conf":   conf.String(),
		"enabled_plugins": "[].\n",
		"env.conf":        "ERL_EPMD_ADDRESS=127.0.0.1\n",
	}
	for name, body := range files {
		if err := os.WriteFile(filepath.Join(n.dir, name), []byte(body), 0o644); err != nil {
			return fmt.Errorf("sandbox: %w", err)
		}
	}
	return nil
}

// moveAndLaunch starts the node again on new ports.
func (n *RabbitNode) moveAndLaunch(all []*RabbitNode) error {
	port, err1 := FreePort()
	dist, err2 := FreePort()
	if err := errors.Join(err1, err2); err != nil {
		return err
	}
	n.Port, n.DistPort = port, dist
	if err := n.writeConfig(all); err != nil {
		return err
	}
	if err := chownRabbit(n.dir); err != nil {
		return err
	}
	return n.launch()
}

// launch starts the node's server in its own process group.
func (n *RabbitNode) launch() error {
	env := []string{
		"HOME=/var/lib/rabbitmq",
		"PATH=" + os.Getenv("PATH"),
		"RABBITMQ_NODENAME=" + n.Name,
		"RABBITMQ_NODE_PORT=" + strconv.Itoa(n.Port),
		"RABBITMQ_DIST_PORT=" + strconv.Itoa(n.DistPort),
		"RABBITMQ_MNESIA_BASE=" + filepath.Join(n.dir, "mnesia"),
		"RABBITMQ_LOG_BASE=" + filepath.Join(n.dir, "log"),
		"RABBITMQ_CONFIG_FILE=" + filepath.Join(n.dir, "rabbitmq.conf"),
		"RABBITMQ_ENABLED_PLUGINS_FILE=" + filepath.Join(n.dir, "enabled_plugins"),
		"RABBITMQ_CONF_ENV_FILE=" + filepath.Join(n.dir, "env.conf"),
		"ERL_FLAGS=-kernel inet_dist_use_interface {127,0,0,1}",
	}
	if os.Geteuid() == 0 {
		n.cmd = exec.Command("runuser", append([]string{"-u", "rabbitmq", "--", "env"}, append(env, rabbitServer)...)...)
	} else {
		n.cmd = exec.Command(rabbitServer)
		n.cmd.Env = env
	}
	out, err := os.OpenFile(filepath.Join(n.dir, "server.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("sandbox: %w", err)
	}
	defer out.Close()
	n.cmd.Stdout, n.cmd.Stderr = out, out
	n.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := n.cmd.Start(); err != nil {
		return fmt.Errorf("sandbox: start %s: %w", n.Name, err)
	}
	n.done = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) { _ = cmd.Wait(); close(done) }(n.cmd, n.done)
	return nil
}

// URL is the node's AMQP URL (guest, default vhost).
func (n *RabbitNode) URL() string { return fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", n.Port) }

// Running reports whether the node's server process runs.
func (n *RabbitNode) Running() bool {
	if n.done == nil {
		return false
	}
	select {
	case <-n.done:
		return false
	default:
		return true
	}
}

// Kill SIGKILLs the node's whole process group, as a crash or a power cut
// would, and waits for it to exit.
func (n *RabbitNode) Kill() {
	if !n.Running() {
		return
	}
	_ = syscall.Kill(-n.cmd.Process.Pid, syscall.SIGKILL)
	<-n.done
}

// Start starts the node again after Kill, with its data, and waits until
// it has booted (it rejoins its cluster).
func (n *RabbitNode) Start(timeout time.Duration) error {
	if err := n.launch(); err != nil {
		return err
	}
	return n.awaitBoot(timeout)
}

func (n *RabbitNode) awaitBoot(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		// await_startup fails at once while the node is not registered
		// with epmd yet: try again until it waits and answers.
		left := max(time.Until(deadline), time.Second)
		ctx, cancel := context.WithTimeout(context.Background(), left)
		out, err := exec.CommandContext(ctx, "rabbitmqctl", "-q", "-n", n.Name, "await_startup", "--timeout", strconv.Itoa(int(left.Seconds()))).CombinedOutput()
		cancel()
		if err == nil {
			return nil
		}
		if !n.Running() || time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(n.dir, "server.log"))
			return fmt.Errorf("sandbox: %s did not boot: %v: %s\n%s", n.Name, err, tail(out, 500), tail(b, 2000))
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// URLs is AMQP_URL for the whole cluster: every node's URL, comma-separated.
func (c *RabbitCluster) URLs() string {
	urls := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		urls[i] = n.URL()
	}
	return strings.Join(urls, ",")
}

// WaitFormed waits until every node runs and reports every other as running.
// A node that exits while booting (a port taken meanwhile by another
// process: ports are picked free long before the node binds them) is
// started again on new ports, twice at most.
func (c *RabbitCluster) WaitFormed(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for _, n := range c.Nodes {
		err := n.awaitBoot(time.Until(deadline))
		for retry := 0; err != nil && !n.Running() && retry < 2; retry++ {
			if err = n.moveAndLaunch(c.Nodes); err == nil {
				err = n.awaitBoot(time.Until(deadline))
			}
		}
		if err != nil {
			return err
		}
	}
	for {
		running, err := c.Nodes[0].runningNodes()
		if err == nil && len(running) == len(c.Nodes) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("sandbox: rabbitmq cluster not formed within %s: running %v, %v", timeout, running, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

func (n *RabbitNode) runningNodes() ([]string, error) {
	out, err := exec.Command("rabbitmqctl", "-q", "-n", n.Name, "cluster_status", "--formatter", "json").Output()
	if err != nil {
		return nil, fmt.Errorf("cluster_status: %w", err)
	}
	var st struct {
		Running []string `json:"running_nodes"`
	}
	if err := json.Unmarshal(out, &st); err != nil {
		return nil, fmt.Errorf("cluster_status: %w", err)
	}
	return st.Running, nil
}

// Leader returns the node that leads quorum queue queue now, asking a node
// that runs.
func (c *RabbitCluster) Leader(queue string) (*RabbitNode, error) {
	for _, n := range c.Nodes {
		if !n.Running() {
			continue
		}
		out, err := exec.Command("rabbitmqctl", "-q", "-n", n.Name, "list_queues", "name", "leader", "--formatter", "json").Output()
		if err != nil {
			continue
		}
		var qs []struct {
			Name   string `json:"name"`
			Leader string `json:"leader"`
		}
		if err := json.Unmarshal(out, &qs); err != nil {
			return nil, fmt.Errorf("sandbox: list_queues: %w", err)
		}
		for _, q := range qs {
			if q.Name != queue {
				continue
			}
			for _, m := range c.Nodes {
				if m.Name == q.Leader {
					return m, nil
				}
			}
			return nil, fmt.Errorf("sandbox: queue %s is led by %q, not a node of this cluster", queue, q.Leader)
		}
		return nil, fmt.Errorf("sandbox: no queue %s", queue)
	}
	return nil, errors.New("sandbox: no running node answered")
}

// Connections counts, by node name, the connections whose client-provided
// name match accepts, asking a node that runs. A connection's node is the
// one whose AMQP port it reached (rabbitmqctl's list_connections has no
// node column): each node of the cluster listens on a port of its own.
func (c *RabbitCluster) Connections(match func(name string) bool) (map[string]int, error) {
	byPort := map[string]string{}
	for _, n := range c.Nodes {
		byPort[strconv.Itoa(n.Port)] = n.Name
	}
	var last error
	for _, n := range c.Nodes {
		if !n.Running() {
			continue
		}
		out, err := exec.Command("rabbitmqctl", "-q", "-n", n.Name, "--timeout", "20", "list_connections", "--no-table-headers", "port", "client_properties").CombinedOutput()
		if err != nil {
			last = fmt.Errorf("sandbox: list_connections on %s: %w: %s", n.Name, err, tail(out, 300))
			continue
		}
		by := map[string]int{}
		for _, line := range strings.Split(string(out), "\n") {
			port, props, ok := strings.Cut(line, "\t")
			if m := connName.FindStringSubmatch(props); ok && m != nil && match(m[1]) {
				if node, ok := byPort[strings.TrimSpace(port)]; ok {
					by[node]++
				}
			}
		}
		return by, nil
	}
	if last != nil {
		return nil, last
	}
	return nil, errors.New("sandbox: no running node answered")
}

// Remove kills every node and deletes their files.
func (c *RabbitCluster) Remove() {
	for _, n := range c.Nodes {
		n.Kill()
	}
	os.RemoveAll(c.dir)
}

// chownRabbit gives dir and everything in it to the rabbitmq user when
// running as root.
func chownRabbit(dir string) error {
	if os.Geteuid() != 0 {
		return nil
	}
	u, err := user.Lookup("rabbitmq")
	if err != nil {
		return fmt.Errorf("sandbox: running as root and there is no rabbitmq user: %w", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return filepath.Walk(dir, func(path string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		return os.Chown(path, uid, gid)
	})
}

func tail(b []byte, n int) string {
	b = []byte(strings.TrimSpace(string(b)))
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}
