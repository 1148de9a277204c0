package consumer_test

import (
	"context"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/consumer"
)

// TestQueuesBeyondThePartitionCountAreWatched: a publisher outside idem
// routes by 4 partitions while the consumers take 2, and no count was ever
// recorded (FormerPartitions 0). The events in <q>.2 and <q>.3 are
// stranded; the consumer must report them (they went unseen).
func TestQueuesBeyondThePartitionCountAreWatched(t *testing.T) {
	t.Parallel()
	var wider broker.Topology
	r := startRig(t, idHandler{apply: func(string) error { return nil }}, func(c *consumer.Config) {
		c.Partitions = 2
		// The application's own publisher declared its 4 queues and sent
		// an event to each before the consumers started.
		wider = broker.TopologyFor(c.Queue, c.BrokerDeliveryLimit)
		wider.Partitions = 4
		conn, err := amqp.Dial(testenv.AMQPURL())
		require.NoError(t, err)
		defer conn.Close()
		ch, err := conn.Channel()
		require.NoError(t, err)
		require.NoError(t, wider.Declare(ch))
		for _, q := range wider.Queues() {
			require.NoError(t, ch.PublishWithContext(context.Background(), "", q, false, false, amqpPublishing("e_"+q)))
		}
		t.Cleanup(func() {
			conn, err := amqp.Dial(testenv.AMQPURL())
			require.NoError(t, err)
			defer conn.Close()
			ch, err := conn.Channel()
			require.NoError(t, err)
			for _, q := range wider.Queues() {
				_, _ = ch.QueueDelete(q, false, false, false)
			}
		})
	})
	require.Eventually(t, func() bool { return r.consumerStats().Stranded == 2 }, 30*time.Second, 20*time.Millisecond,
		"the events in the partitions beyond the consumer's count were not reported")
	require.Equal(t, []string{wider.PartitionQueue(2), wider.PartitionQueue(3)}, r.consumerStats().StrandedIn)
	require.Eventually(t, func() bool { return r.stats["processed"].Load() == 2 }, 30*time.Second, 10*time.Millisecond,
		"the consumer's own partitions were not consumed")
}
