package testenv

import (
	"errors"
	"net"
	"strconv"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/sandbox"
)

// VHost creates a RabbitMQ virtual host of the test's own, so that the test
// may close every connection in it without touching other tests, and returns
// an AMQP URL for it. The vhost and all in it are deleted at the end. It
// needs rabbitmqctl on this machine; without it the test is skipped.
func VHost(t testing.TB) string {
	t.Helper()
	name := "idem_" + Name(t)
	u, err := sandbox.AddVHost(AMQPURL(), name)
	if errors.Is(err, sandbox.ErrNoRabbitmqctl) {
		t.Skip(err)
	}
	t.Cleanup(func() {
		if err := sandbox.DeleteVHost(name); err != nil {
			t.Logf("testenv: %v", err)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// User creates a RabbitMQ user of the test's own, with every permission in
// the vhost of amqpURL, and returns an AMQP URL that logs in as it and a
// func that changes its password (the URL keeps the first). The user is
// deleted at the end. It needs rabbitmqctl on this machine; without it the
// test is skipped.
func User(t testing.TB, amqpURL string) (string, func(password string)) {
	t.Helper()
	name := "idem_" + Name(t)
	u, err := sandbox.AddUser(amqpURL, name, name)
	if errors.Is(err, sandbox.ErrNoRabbitmqctl) {
		t.Skip(err)
	}
	t.Cleanup(func() {
		if err := sandbox.DeleteUser(name); err != nil {
			t.Logf("testenv: %v", err)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	return u, func(password string) {
		t.Helper()
		if err := sandbox.ChangePassword(name, password); err != nil {
			t.Fatal(err)
		}
	}
}

// CloseConnections closes every client connection in the vhost of amqpURL,
// as a broker restart or a network cut would.
func CloseConnections(t testing.TB, amqpURL string) {
	t.Helper()
	if err := sandbox.CloseVHostConnections(amqpURL, "idem-lab chaos test"); err != nil {
		t.Fatal(err)
	}
}

// AMQPCut puts a sandbox.AMQPCut in front of the broker at AMQPURL and
// returns it and the AMQP URL through it; it is closed at the end.
func AMQPCut(t testing.TB) (*sandbox.AMQPCut, string) {
	t.Helper()
	u, err := amqp.ParseURI(AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	p, err := sandbox.StartAMQPCut(net.JoinHostPort(u.Host, strconv.Itoa(u.Port)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p, p.URL(AMQPURL())
}
