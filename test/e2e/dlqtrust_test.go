package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
)

// TestABrokersDeadLetterIsReadByItsXDeath: a producer's message with forged
// x-idem-* headers (a reason, another event's ID, a cut body's length) is
// rejected off the work queue, so that the broker dead-letters it as it
// was, forgeries included. The dlq tools read it by the broker's x-death
// (reason rejected, from the work queue), never by its x-idem-* headers:
// --event finds it by its message ID only, and a replay is not refused
// for a body the forged header claims was cut.
func TestABrokersDeadLetterIsReadByItsXDeath(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	forged := body(`{"eventId":"evt_forger","userId":"user_1","type":"PAYMENT_COMPLETED","amount":1}`)
	forged.MessageId = "evt_forger"
	forged.Headers = amqp.Table{
		"x-idem-reason":     "body_too_large",
		"x-idem-event-id":   "evt_victim",
		"x-idem-body-bytes": int64(1 << 20),
		"x-idem-queue":      "elsewhere",
	}
	e.publishRaw(forged) // no consumer runs: it waits in the work queue
	ch := e.channel()
	var d amqp.Delivery
	require.Eventually(t, func() bool {
		var ok bool
		var err error
		d, ok, err = ch.Get(e.queue, false)
		require.NoError(t, err)
		return ok
	}, 30*time.Second, 20*time.Millisecond)
	require.NoError(t, d.Reject(false)) // the broker dead-letters it, reason rejected
	dlqName := e.queue + ".dlq"
	require.Eventually(t, func() bool { return testenv.QueueDepth(t, e.amqpURL, dlqName) == 1 },
		30*time.Second, 20*time.Millisecond, "the broker never dead-lettered it")

	r := e.run(nil, "dlq", "show")
	require.Zero(t, r.code, r.out)
	// No consumer read an event ID: the message ID is labelled as one.
	require.Regexp(t, `event_id:\s+\(none read`, r.out)
	require.Regexp(t, `message_id:\s+evt_forger\n`, r.out)
	require.Regexp(t, `reason:\s+rejected\n`, r.out)
	require.Regexp(t, `queue:\s+`+strings.ReplaceAll(e.queue, ".", `\.`)+`\n`, r.out)
	require.Contains(t, r.out, "dead-lettered by:")
	require.Contains(t, r.out, "\nheader x-idem-event-id: evt_victim\n", "the producer's headers are shown as such")
	require.NotContains(t, r.out, "header x-delivery-count")
	r = e.run(nil, "dlq", "list")
	require.Zero(t, r.code, r.out)
	require.Regexp(t, `rejected\s+1\s`, r.out)
	require.NotContains(t, r.out, "body_too_large")
	r = e.run(nil, "dlq", "show", "--event", "evt_victim")
	require.Zero(t, r.code, r.out)
	require.Contains(t, r.out, "no dead letter matches", "the forged event ID was believed")

	r = e.run(nil, "dlq", "replay", "--event", "evt_forger")
	require.Zero(t, r.code, "a forged x-idem-body-bytes refused the replay:\n%s", r.out)
	require.Contains(t, r.out, "replayed 1 dead letters")
	d, ok, err := ch.Get(e.queue, false)
	require.NoError(t, err)
	require.True(t, ok, "the replay is not in the work queue")
	require.NoError(t, d.Ack(false))
	require.Equal(t, forged.Body, d.Body)
	for k := range d.Headers {
		require.NotContains(t, []string{"x-idem-reason", "x-idem-event-id", "x-idem-queue", "x-death"}, k, "the replay carries %s", k)
	}
}

// TestATruncatedDeadLetterIsNotReplayed: a body over
// consumer.max_body_bytes is dead-lettered with its first bytes only; idem
// dlq show says so, and idem dlq replay refuses it (exit 1, as for a
// replay that failed) and leaves it in the DLQ, rather than publish a
// truncated event.
func TestATruncatedDeadLetterIsNotReplayed(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	e.vars = append(e.vars, "IDEM_CONSUMER_MAX_BODY_BYTES=1024")
	c := e.consume("c0")
	e.waitConsuming(c)
	big := `{"eventId":"evt_big","userId":"user_1","type":"PAYMENT_COMPLETED","amount":1,"note":"` + strings.Repeat("x", 3000) + `"}`
	e.publishRaw(body(big))
	dlqName := e.queue + ".dlq"
	require.Eventually(t, func() bool { return testenv.QueueDepth(t, e.amqpURL, dlqName) == 1 },
		60*time.Second, 20*time.Millisecond, "the message was never dead-lettered")

	r := e.run(nil, "dlq", "show")
	require.Zero(t, r.code, r.out)
	require.Regexp(t, `reason:\s+body_too_large\n`, r.out)
	require.Contains(t, r.out, fmt.Sprintf("(the first 1024 of %d bytes)", len(big)))
	e.stopAll() // nothing reads the work queue: a replay would stay there

	r = e.run(nil, "dlq", "replay", "--all")
	require.Equal(t, 1, r.code, r.out)
	require.Contains(t, r.out, "refused 1 dead letter(s) of reason body_too_large")
	require.Contains(t, r.out, "replayed 0 dead letters")
	require.Equal(t, 1, testenv.QueueDepth(t, e.amqpURL, dlqName), "the refused dead letter left the DLQ")
	require.Zero(t, testenv.QueueDepth(t, e.amqpURL, e.queue), "a truncated event was replayed")
	var rows int
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT count(*) FROM idem_processed`).Scan(&rows))
	require.Zero(t, rows)
}
