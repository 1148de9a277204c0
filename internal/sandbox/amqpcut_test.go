package sandbox_test

import (
	"net/url"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
)

// DropWhere closes the connections through the proxy whose client-provided
// name it accepts, and no other: a chaos run's amqp-close closes consume
// connections and leaves the publishing ones alone.
func TestAMQPCutDropsConnectionsByName(t *testing.T) {
	t.Parallel()
	u, err := url.Parse(testenv.AMQPURL())
	require.NoError(t, err)
	cut, err := sandbox.StartAMQPCut(u.Host)
	require.NoError(t, err)
	t.Cleanup(cut.Close)
	dial := func(name string) *amqp.Connection {
		c, err := amqp.DialConfig(cut.URL(testenv.AMQPURL()), amqp.Config{Properties: amqp.Table{"connection_name": name}})
		require.NoError(t, err)
		t.Cleanup(func() { c.Close() })
		return c
	}
	victim, bystander := dial("victim-1"), dial("victim-1-publish")

	require.Equal(t, 1, cut.DropWhere(func(name string) bool { return name == "victim-1" }))
	require.Eventually(t, victim.IsClosed, 5*time.Second, 10*time.Millisecond)
	require.False(t, bystander.IsClosed(), "a connection of another name was closed")
	ch, err := bystander.Channel()
	require.NoError(t, err)
	ch.Close()
	require.Equal(t, 1, cut.DropWhere(func(string) bool { return true }))
}
