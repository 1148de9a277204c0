package sandbox

import (
	"errors"
	"fmt"
	"net/url"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
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

// AddUser creates RabbitMQ user name with password, grants it every
// permission in the vhost of amqpURL, and returns amqpURL logging in as it.
func AddUser(amqpURL, name, password string) (string, error) {
	u, err := url.Parse(amqpURL)
	if err != nil {
		return "", fmt.Errorf("sandbox: AMQP URL: %w", err)
	}
	vhost := strings.TrimPrefix(u.Path, "/")
	if vhost == "" {
		vhost = "/"
	}
	if err := rabbitmqctl("add_user", name, password); err != nil {
		return "", err
	}
	if err := rabbitmqctl("set_permissions", "-p", vhost, name, ".*", ".*", ".*"); err != nil {
		return "", err
	}
	u.User = url.UserPassword(name, password)
	return u.String(), nil
}

// ChangePassword sets user name's password. Connections already open stay
// open; the next login needs the new one.
func ChangePassword(name, password string) error {
	return rabbitmqctl("change_password", name, password)
}

// DeleteUser deletes user name.
func DeleteUser(name string) error { return rabbitmqctl("delete_user", name) }

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
// client-provided name match accepts. It takes two rabbitmqctl runs, one to
// list and one to close, however many connections match: each run boots an
// Erlang VM for a second or so of CPU, and one run per connection, even
// side by side, took twenty seconds on two busy cores.
func CloseConnectionsWhere(node string, match func(name string) bool, why string) (int, error) {
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		return 0, ErrNoRabbitmqctl
	}
	var via []string
	if node != "" {
		via = []string{"-n", node}
	}
	out, err := exec.Command("rabbitmqctl", append(via, "-q", "list_connections", "--no-table-headers", "client_properties")...).Output()
	if err != nil {
		return 0, fmt.Errorf("sandbox: rabbitmqctl list_connections: %w", err)
	}
	var names []string
	for _, line := range strings.Split(string(out), "\n") {
		if m := connName.FindStringSubmatch(line); m != nil && match(m[1]) {
			names = append(names, erlangBinary(m[1]))
		}
	}
	if len(names) == 0 {
		return 0, nil
	}
	// Closed by name in one run; a connection that closed since the
	// listing is not counted, and not an error. One still opening has no
	// client properties yet (none, not a list): it is not named.
	expr := fmt.Sprintf(`Names = [%s],
		Named = fun(P) ->
			case catch rabbit_networking:connection_info(P, [client_properties]) of
				[{client_properties, Props}] when is_list(Props) ->
					case lists:keyfind(<<"connection_name">>, 1, Props) of
						{_, _, N} -> lists:member(N, Names);
						_ -> false
					end;
				_ -> false
			end
		end,
		length([ok || P <- rabbit_networking:connections(), Named(P),
			ok =:= catch rabbit_networking:close_connection(P, %s)]).`,
		strings.Join(names, ", "), erlangString(why))
	out, err = exec.Command("rabbitmqctl", append(via, "-q", "eval", expr)...).CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("sandbox: rabbitmqctl eval (close connections): %v: %s", err, out)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(out)))
	if err != nil {
		return 0, fmt.Errorf("sandbox: rabbitmqctl eval (close connections) printed %q", out)
	}
	return n, nil
}

// erlangString and erlangBinary spell s as an Erlang string (a list of
// bytes) and binary, byte by byte: no quoting to get wrong.
func erlangString(s string) string { return "[" + erlangBytes(s) + "]" }

func erlangBinary(s string) string { return "<<" + erlangBytes(s) + ">>" }

func erlangBytes(s string) string {
	var b strings.Builder
	for i := range len(s) {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(int(s[i])))
	}
	return b.String()
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
