package sandbox

import (
	"errors"
	"fmt"
	"net/url"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
)

// ErrNoRabbitmqctl means rabbitmqctl is not installed here.
var ErrNoRabbitmqctl = errors.New("sandbox: rabbitmqctl not installed")

// AddVHost creates RabbitMQ virtual host name, grants the user of amqpURL
// every permission in it, and returns an AMQP URL for it.
func AddVHost(amqpURL, name string) (string, error) {
	u, err := url.Parse(amqpURL)
	if err != nil {
		return "", fmt.Errorf("sandbox: AMQP URL: %w", err)
	}
	if err := rabbitmqctl("add_vhost", name); err != nil {
		return "", err
	}
	user := "guest"
	if u.User != nil {
		user = u.User.Username()
	}
	if err := rabbitmqctl("set_permissions", "-p", name, user, ".*", ".*", ".*"); err != nil {
		return "", err
	}
	u.Path = "/" + name
	return u.String(), nil
}

// DeleteVHost deletes a virtual host and everything in it.
func DeleteVHost(name string) error { return rabbitmqctl("delete_vhost", name) }

// CloseVHostConnections closes every client connection in the vhost of
// amqpURL, as a broker restart or a network cut would.
func CloseVHostConnections(amqpURL, why string) error {
	u, err := url.Parse(amqpURL)
	if err != nil {
		return fmt.Errorf("sandbox: AMQP URL: %w", err)
	}
	return rabbitmqctl("close_all_connections", "--vhost", strings.TrimPrefix(u.Path, "/"), why)
}

var connName = regexp.MustCompile(`\{"connection_name","([^"]*)"\}`)

// CloseConnections closes the connections whose client-provided name
// starts with prefix, and only those, and returns how many it closed.
func CloseConnections(prefix, why string) (int, error) { return CloseConnectionsVia("", prefix, why) }

// CloseConnectionsVia is CloseConnections on the cluster of node (the local
// node if empty): every node's connections.
func CloseConnectionsVia(node, prefix, why string) (int, error) {
	return CloseConnectionsWhere(node, func(name string) bool { return strings.HasPrefix(name, prefix) }, why)
}

// CloseConnectionsWhere is CloseConnectionsVia for the connections whose
// client-provided name match accepts. Each close is a rabbitmqctl run of a
// second or two, so close no more than the fault needs.
func CloseConnectionsWhere(node string, match func(name string) bool, why string) (int, error) {
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		return 0, ErrNoRabbitmqctl
	}
	var via []string
	if node != "" {
		via = []string{"-n", node}
	}
	out, err := exec.Command("rabbitmqctl", append(via, "-q", "list_connections", "--no-table-headers", "pid", "client_properties")...).Output()
	if err != nil {
		return 0, fmt.Errorf("sandbox: rabbitmqctl list_connections: %w", err)
	}
	var pids []string
	for _, line := range strings.Split(string(out), "\n") {
		pid, props, ok := strings.Cut(line, "\t")
		if !ok {
			continue
		}
		if m := connName.FindStringSubmatch(props); m != nil && match(m[1]) {
			pids = append(pids, pid)
		}
	}
	// Closed at once, not one after the other: each rabbitmqctl run takes
	// a second or more, and the connections should go down together.
	var closed atomic.Int64
	var wg sync.WaitGroup
	for _, pid := range pids {
		wg.Go(func() {
			// A connection that closed since the listing is not an error.
			if err := rabbitmqctl(append(via, "close_connection", pid, why)...); err == nil {
				closed.Add(1)
			}
		})
	}
	wg.Wait()
	n := int(closed.Load())
	return n, nil
}

func rabbitmqctl(args ...string) error {
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		return ErrNoRabbitmqctl
	}
	out, err := exec.Command("rabbitmqctl", append([]string{"-q"}, args...)...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("sandbox: rabbitmqctl %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return nil
}
