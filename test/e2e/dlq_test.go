package e2e

import (
	"context"
	"encoding/json"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/guard"
)

// TestDeadLetterTools runs idem dlq list, show, replay and purge, and idem
// inspect, against a real broker and a running consumer: a replayed event
// lands exactly once, a replay that fails again lands in the dead-letter
// queue once (not in a loop), replaying a processed event is a harmless
// duplicate, and purge deletes only what it is told to.
func TestDeadLetterTools(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	e.vars = append(e.vars, "IDEM_CONSUMER_DELIVERY_LIMIT=2", "IDEM_LOG_FORMAT=json", "IDEM_LOG_LEVEL=debug")
	e.poisonLedger()
	c0 := e.consume("c0")
	pay := func(id, user, amount string) amqp.Publishing {
		return body(`{"eventId":"` + id + `","userId":"` + user + `","type":"PAYMENT_COMPLETED","amount":` + amount + `}`)
	}
	dlqName := e.queue + ".dlq"
	dlqDepth := func() int { return testenv.QueueDepth(t, e.amqpURL, dlqName) }
	waitDLQ := func(n int) {
		t.Helper()
		require.Eventually(t, func() bool { return dlqDepth() == n }, 60*time.Second, 20*time.Millisecond, "the DLQ never held %d", n)
	}
	ok := func(args ...string) string {
		t.Helper()
		r := e.run(nil, args...)
		require.Zero(t, r.code, "idem %v:\n%s", args, r.out)
		return r.out
	}
	usage := func(args ...string) string { // a usage error: exit 2
		t.Helper()
		r := e.run(nil, args...)
		require.Equal(t, 2, r.code, "idem %v:\n%s", args, r.out)
		return r.out
	}

	e.publishRaw(pay("evt_a", "user_1", "100"))
	e.waitRows(1)
	e.publishRaw(
		body(`{"eventId":`),                 // invalid_json
		pay("evt_a", "user_1", "999"),       // payload_conflict
		pay("evt_p", "user_poison", "7"),    // handler_failed, twice
		pay("evt_late", "user_poison", "5"), // handler_failed
		pay("evt_neg", "user_1", "-5"),      // invalid_field, after the event ID was read
	)
	waitDLQ(5)

	// A dead letter of an event whose body was partly decodable is found
	// by its event ID (the consumer's header, not a decode of the body).
	out := ok("dlq", "show", "--event", "evt_neg")
	require.Regexp(t, `event_id:\s+evt_neg\n`, out)
	require.Regexp(t, `reason:\s+invalid_field\n`, out)
	// An undecodable one has no event ID: its message ID is not shown as
	// one (it was, under event_id:).
	out = ok("dlq", "show", "--reason", "invalid_json")
	require.Regexp(t, `event_id:\s+\(none read: the consumer did not decode one`, out)
	require.Contains(t, ok("dlq", "purge", "--reason", "invalid_field", "--yes"), "purged 1 dead letters")
	waitDLQ(4)
	// A reason idem never writes is refused, naming the known ones.
	out = usage("dlq", "purge", "--reason", "invalid_jsn", "--yes")
	require.Contains(t, out, `"invalid_jsn" matched no dead letter, and is not a reason idem writes`)
	require.Contains(t, out, "invalid_json")
	usage("dlq", "show", "-n", "0")

	// list: counts by reason, with ages.
	out = ok("dlq", "list")
	require.Contains(t, out, dlqName+": 4 dead letters")
	require.Regexp(t, `handler_failed\s+2\s+\d+s\s+\d+s`, out)
	require.Regexp(t, `invalid_json\s+1\s`, out)
	require.Regexp(t, `payload_conflict\s+1\s`, out)

	// show: one event's dead letter, and a conflict with both hashes.
	out = ok("dlq", "show", "--event", "evt_p")
	require.Regexp(t, `reason:\s+handler_failed\n`, out)
	require.Regexp(t, `attempts:\s+2\n`, out)
	require.Contains(t, out, "poisoned payment")
	require.Contains(t, out, `"eventId":"evt_p"`)
	require.NotContains(t, out, "evt_late")
	out = ok("dlq", "show", "--reason", "payload_conflict")
	require.Contains(t, out, "ORIGINAL PROCESSED AT")
	require.Regexp(t, `evt_a\s+\d{4}-\d\d-\d\dT\S+\s+[0-9a-f]{64}\s+[0-9a-f]{64}`, out)
	hashes := regexp.MustCompile(`([0-9a-f]{64})\s+([0-9a-f]{64})`).FindStringSubmatch(out)
	require.NotEqual(t, hashes[1], hashes[2], "the two payloads differ")
	require.Equal(t, 4, dlqDepth(), "show moves nothing")

	// replay: refuses without a selector; a dry run moves nothing.
	require.Contains(t, usage("dlq", "replay"), "--reason R, --event ID, or --all")
	out = ok("dlq", "replay", "--reason", "handler_failed", "--dry-run")
	require.Contains(t, out, "would replay evt_p")
	require.Contains(t, out, "would replay 2 dead letters")
	require.Equal(t, 4, dlqDepth())

	// The handler is fixed: the replayed events are applied, once each.
	_, err := e.pool.Exec(context.Background(), `DROP TRIGGER poison ON payments_ledger`)
	require.NoError(t, err)
	out = ok("dlq", "replay", "--reason", "handler_failed")
	require.Contains(t, out, "replayed 2 dead letters to "+e.queue+"; 2 others left")
	e.waitRows(3)
	waitDLQ(2)

	// A replay that fails again comes back once, counted, not in a loop.
	ok("dlq", "replay", "--reason", "invalid_json")
	waitDLQ(2)
	out = ok("dlq", "show", "--reason", "invalid_json")
	require.Regexp(t, `replays:\s+1\n`, out)
	require.Contains(t, ok("dlq", "list"), ": 2 dead letters")

	// A dead letter whose event was processed meanwhile: the replay is a
	// duplicate, the ledger unchanged.
	ch := e.channel()
	require.NoError(t, ch.PublishWithContext(context.Background(), "", dlqName, false, false,
		amqp.Publishing{Body: pay("evt_p", "user_poison", "7").Body, Timestamp: time.Now(), DeliveryMode: amqp.Persistent,
			Headers: amqp.Table{wire.HeaderEventID: "evt_p", wire.HeaderReason: wire.ReasonHandlerFailed}}))
	waitDLQ(3)
	out = ok("dlq", "replay", "--event", "evt_p")
	require.Contains(t, out, "replayed 1 dead letters")
	waitDLQ(2)
	require.Eventually(t, func() bool { return testenv.QueueDepth(t, e.amqpURL, e.queue) == 0 }, 30*time.Second, 20*time.Millisecond)

	// inspect shows each tier for one event.
	out = ok("inspect", "evt_p")
	require.Regexp(t, `verdict:\s+processed once`, out)
	require.Regexp(t, `redis \S+:evt_p:\s+done, payload hash [0-9a-f]{64}`, out)
	require.Regexp(t, `marker history:\s+[0-9a-f]{12}, the database's now: trusted`, out)
	require.Contains(t, out, "user user_poison, amount 7")
	require.NotContains(t, out, "at all")
	// With a prefix the consumers do not use, "no key" is not left to pass
	// for an answer about the event.
	other := "not-the-consumers-" + testenv.Name(t)
	r := e.run([]string{"IDEM_REDIS_PREFIX=" + other}, "inspect", "evt_p")
	require.Zero(t, r.code, r.out)
	require.Regexp(t, `no key \(never claimed`, r.out)
	require.Contains(t, r.out, "under prefix \""+other+"\" at all")

	// purge: refuses without --yes; deletes only the reason it is given.
	require.Contains(t, usage("dlq", "purge"), "add --yes")
	require.Contains(t, ok("dlq", "purge", "--reason", "invalid_json", "--yes"), "purged 1 dead letters")
	require.Equal(t, 1, dlqDepth())
	require.Regexp(t, `reason:\s+payload_conflict\n`, ok("dlq", "show"))
	require.Contains(t, ok("dlq", "purge", "--yes"), "purged 1 dead letters")
	require.Equal(t, 0, dlqDepth())

	stats := e.stopAll()
	e.requireLedger(map[string]int{"evt_a": 1, "evt_p": 1, "evt_late": 1})
	var deliveries int64
	for _, o := range guard.Outcomes() {
		deliveries += stats[o.String()]
	}
	requireEventLogLines(t, c0.LogPath, int(deliveries))
	require.Positive(t, stats["duplicate_redis"]+stats["duplicate_postgres"], "the replay of a processed event is a duplicate: %v", stats)
}

// requireLedger checks how many ledger rows each event has, and that there
// are no others.
func (e *env) requireLedger(want map[string]int) {
	e.t.Helper()
	rows, err := e.pool.Query(context.Background(), `SELECT event_id, count(*) FROM payments_ledger GROUP BY event_id`)
	require.NoError(e.t, err)
	got := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		require.NoError(e.t, rows.Scan(&id, &n))
		got[id] = n
	}
	require.NoError(e.t, rows.Err())
	require.Equal(e.t, want, got)
}

// requireEventLogLines checks a JSON log at debug level: every line parses,
// each of the n deliveries has one line with its outcome (settled, requeued,
// dead-lettered, a conflict), and each such line carries event_id, scope,
// outcome and reason.
func requireEventLogLines(t *testing.T, path string, n int) {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	perEvent := 0
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &rec), "not JSON: %s", line)
		if _, ok := rec["outcome"]; !ok {
			continue
		}
		perEvent++
		for _, k := range []string{"event_id", "scope", "outcome", "reason"} {
			require.Contains(t, rec, k, line)
		}
		require.Equal(t, "payments", rec["scope"], line)
		if rec["reason"] != "invalid_json" { // every other dead letter got as far as its event ID
			require.NotEmpty(t, rec["event_id"], line)
		}
	}
	require.Equal(t, n, perEvent, "one line per delivery")
}
