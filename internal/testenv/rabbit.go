package testenv

import (
	"net/url"
	"os/exec"
	"strings"
	"testing"
)

// VHost creates a RabbitMQ virtual host of the test's own, so that the test
// may close every connection in it without touching other tests, and returns
// an AMQP URL for it. The vhost and all in it are deleted at the end. It
// needs rabbitmqctl on this machine; without it the test is skipped.
func VHost(t testing.TB) string {
	t.Helper()
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		t.Skip("rabbitmqctl not installed")
	}
	name := "idem_" + Name(t)
	ctl(t, "add_vhost", name)
	t.Cleanup(func() {
		if out, err := exec.Command("rabbitmqctl", "-q", "delete_vhost", name).CombinedOutput(); err != nil {
			t.Logf("testenv: delete vhost %s: %v: %s", name, err, out)
		}
	})
	u, err := url.Parse(AMQPURL())
	if err != nil {
		t.Fatalf("testenv: AMQP_URL: %v", err)
	}
	user := "guest"
	if u.User != nil {
		user = u.User.Username()
	}
	ctl(t, "set_permissions", "-p", name, user, ".*", ".*", ".*")
	u.Path = "/" + name
	return u.String()
}

// CloseConnections closes every client connection in vhost, as a broker
// restart or a network cut would.
func CloseConnections(t testing.TB, amqpURL string) {
	t.Helper()
	u, err := url.Parse(amqpURL)
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	ctl(t, "close_all_connections", "--vhost", strings.TrimPrefix(u.Path, "/"), "idem chaos test")
}

func ctl(t testing.TB, args ...string) {
	t.Helper()
	out, err := exec.Command("rabbitmqctl", append([]string{"-q"}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("testenv: rabbitmqctl %s: %v: %s", strings.Join(args, " "), err, out)
	}
}
