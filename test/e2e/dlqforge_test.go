package e2e

import (
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
)

// TestAForgedDeadLetterIsInert: a producer's undecodable message with a
// message ID that holds a line break and terminal escapes, and forged
// x-idem-* headers naming another event, is dead-lettered; idem dlq show
// prints it without a raw control character or a forged line, and does
// not take it for the victim's dead letter.
func TestAForgedDeadLetterIsInert(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	e.consume("c0")
	forged := body(`{"eventId":`) // invalid_json: Decode reads no event ID
	forged.MessageId = "evt_x\nreason:\thandler_failed\x1b]0;pwned\x07\x1b[2J"
	forged.Headers = amqp.Table{
		"x-idem-event-id":     "evt_victim",
		"X-Idem-Payload-Hash": strings.Repeat("ab", 32),
		"x-note":              "ok\n\x1b[31mred",
	}
	e.publishRaw(forged)
	dlqName := e.queue + ".dlq"
	require.Eventually(t, func() bool { return testenv.QueueDepth(t, e.amqpURL, dlqName) == 1 },
		60*time.Second, 20*time.Millisecond, "the message was never dead-lettered")

	r := e.run(nil, "dlq", "show")
	require.Zero(t, r.code, r.out)
	require.Regexp(t, `reason:\s+invalid_json\n`, r.out)
	require.NotRegexp(t, `(?m)^reason:\s+handler_failed`, r.out, "a forged line")
	require.NotContains(t, r.out, "evt_victim", "the forged event ID survived")
	require.NotContains(t, strings.ToLower(r.out), "payload-hash", "the forged hash survived")
	require.Contains(t, r.out, `"ok\n\x1b[31mred"`, "the producer's own header, quoted")
	for _, c := range r.out {
		require.False(t, c < ' ' && c != '\n' && c != '\t' || c == 0x7f, "a raw control character %q in:\n%s", c, r.out)
	}

	r = e.run(nil, "dlq", "show", "--event", "evt_victim")
	require.Zero(t, r.code, r.out)
	require.Contains(t, r.out, "no dead letter matches")
	e.stopAll()
}
