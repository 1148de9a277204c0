package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
)

// TestThePartitionCountIsRecorded: a stream published with 4 partitions and
// consumed with 2 stranded the events on .2 and .3, while the consumers
// reported ready. The count is now recorded where consumers and idem publish
// see it; a mismatch is refused at start; it changes only through idem
// repartition, once the queues are idle; and a message a stale publisher
// sends to a queue of the old layout is reported, not silently left.
func TestThePartitionCountIsRecorded(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	e.vars = append(e.vars, "IDEM_PARTITIONS=4")
	t.Cleanup(func() {
		for p := range 4 {
			_ = sandbox.DeleteQueue(e.amqpURL, fmt.Sprintf("%s.%d", e.queue, p))
		}
	})
	pub := e.run(nil, "publish", "--count", "10", "--users", "10", "--dup-ratio", "0", "--quiet")
	require.Equal(t, 0, pub.code, pub.out)

	// Consumers configured with 2 are refused, and so is a publisher.
	two := []string{"IDEM_PARTITIONS=2"}
	for _, args := range [][]string{{"consume", "--no-migrate"}, {"publish", "--count", "1", "--quiet"}} {
		r := e.run(two, args...)
		require.Equal(t, 1, r.code, r.out)
		require.Contains(t, r.out, "was set up with 4 partition(s), and this process is configured with 2", args)
	}
	// repartition refuses while the queues hold messages.
	r := e.run(nil, "repartition", "--to", "2")
	require.Equal(t, 1, r.code, r.out)
	require.Contains(t, r.out, "are not idle")

	// Drained by consumers of the recorded layout, the stream moves to 2.
	e.consume("c4")
	e.waitRows(10)
	e.stopAll()
	r = e.run(nil, "repartition", "--to", "2")
	require.Equal(t, 0, r.code, r.out)
	require.Contains(t, r.out, "4 partition(s) → 2")

	// A stale publisher still sends to partition 3: the consumers of the
	// new layout report it.
	addr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	e.consume("c2", "IDEM_PARTITIONS=2", "IDEM_METRICS_ADDR="+addr)
	ch := e.channel()
	require.NoError(t, ch.PublishWithContext(context.Background(), "", e.queue+".3", false, false, amqp.Publishing{
		MessageId: "m_stale", DeliveryMode: amqp.Persistent, Timestamp: time.Now(),
		Body: []byte(`{"eventId":"evt_stale","userId":"user_x","type":"PAYMENT_COMPLETED","amount":1}`),
	}))
	require.Eventually(t, func() bool {
		s, err := tryScrape(addr)
		return err == nil && s.value("idem_stranded_messages") == 1
	}, 30*time.Second, 50*time.Millisecond, "the stranded message was not reported")
	code, ready := get(t, "http://"+addr+"/readyz")
	require.Equal(t, 200, code, ready)
	require.Contains(t, ready, e.queue+".3, which nobody consumes", ready)
	e.waitLog("messages stranded in queues of the stream that nobody consumes")
	e.stopAll()
}
