package sandbox_test

import (
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
)

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
