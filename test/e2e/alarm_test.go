package e2e

import (
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/wire"
)

// TestADeadLetterNeverBlocksTheAcks: during a RabbitMQ memory alarm the
// broker stops reading every connection that publishes. A dead letter
// published on the connection the consumer acks on stopped every ack behind
// it (31 of 100 events applied, the rest unacked until the alarm ended).
// Dead letters now go out on a connection of their own: the good events are
// acked during the alarm, the bad one waits unacked and lands in the DLQ
// once the alarm clears; the block shows in /readyz and the metrics.
//
// It runs on a RabbitMQ node of its own, alone (not in parallel): the alarm
// blocks every publisher of its node.
func TestADeadLetterNeverBlocksTheAcks(t *testing.T) {
	testenv.Shared(t) // before its node boots, not only in newEnv
	mq, err := sandbox.StartRabbitCluster(1, 2*time.Minute)
	if mq != nil {
		t.Cleanup(mq.Remove)
	}
	if err != nil && strings.Contains(err.Error(), "not installed") {
		t.Skip(err)
	}
	require.NoError(t, err)
	node := mq.Nodes[0]
	e := newEnv(t, "", node.URL())
	ctl := func(args ...string) {
		t.Helper()
		out, err := exec.Command("rabbitmqctl", append([]string{"-q", "-n", node.Name}, args...)...).CombinedOutput()
		require.NoError(t, err, "%s", out)
	}

	// The stream: a bad message first, then 100 good events.
	const n = 100
	msgs := []amqp.Publishing{body(`{"eventId":`)}
	msgs[0].MessageId = "m_bad"
	for i := range n {
		msgs = append(msgs, body(fmt.Sprintf(`{"eventId":"evt_a%d","userId":"user_a","type":"PAYMENT_COMPLETED","amount":1}`, i)))
	}
	e.publishRaw(msgs...)

	ctl("set_vm_memory_high_watermark", "0") // every publisher of the node is blocked from now on
	t.Cleanup(func() {
		_ = exec.Command("rabbitmqctl", "-q", "-n", node.Name, "set_vm_memory_high_watermark", "0.4").Run()
	})
	addr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	e.consume("c0", "IDEM_METRICS_ADDR="+addr)

	// Every good event is applied and acked during the alarm; the bad
	// message alone waits, unacked.
	require.Eventually(t, func() bool { return e.ledgerRows() == n }, 60*time.Second, 20*time.Millisecond,
		"the good events behind a dead letter were not applied during the alarm")
	require.Eventually(t, func() bool {
		s, err := tryScrape(addr)
		return err == nil && s.value("idem_publish_blocked") == 1 &&
			s.value("idem_deliveries_total", "outcome", "processed") == n && s.value("idem_prefetch_in_use") == 1
	}, 60*time.Second, 20*time.Millisecond, "the good events were not acked, or the block not shown")
	code, ready := get(t, "http://"+addr+"/readyz")
	require.Equal(t, 200, code, ready)
	require.Contains(t, ready, "rabbitmq_publishing", ready)
	require.Contains(t, ready, "blocked by the broker", ready)
	require.Equal(t, 0, testenv.QueueDepth(t, e.amqpURL, e.queue+".dlq"), "a dead letter was published during the alarm")

	// The alarm clears: the dead letter lands, the queue empties.
	ctl("set_vm_memory_high_watermark", "0.4")
	letters := e.deadLetters(1)
	require.Equal(t, "m_bad", letters[0].MessageId)
	require.Equal(t, "invalid_json", letters[0].Headers[wire.HeaderReason])
	stats := e.stopAll()
	require.Equal(t, int64(n), stats["processed"], "%v", stats)
	require.Equal(t, int64(1), stats["dead_lettered"], "%v", stats)
	require.Positive(t, stats["count/"+wire.CounterPublishBlocked], "%v", stats)
	require.Equal(t, 0, testenv.QueueDepth(t, e.amqpURL, e.queue))
}
