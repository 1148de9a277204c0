package e2e

import (
	"context"
	"sort"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/guard"
)

func body(s string) amqp.Publishing {
	return amqp.Publishing{ContentType: "application/json", Body: []byte(s)}
}

// TestBadInputIsDeadLetteredWithAReason sends every kind of bad message
// between good ones. Each bad one must land in the dead-letter queue with its
// reason, and the good ones behind it must still be applied.
func TestBadInputIsDeadLetteredWithAReason(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	// reject: an untimed event is dead-lettered at once (auto processes it
	// until the first prune: TestUntimedEventsByDefault).
	e.vars = append(e.vars, "IDEM_CONSUMER_DELIVERY_LIMIT=3", "IDEM_CONSUMER_UNTIMED=reject")
	e.poisonLedger()
	// A balance one payment short of overflowing bigint.
	_, err := e.pool.Exec(context.Background(), `INSERT INTO account_balances (user_id, balance) VALUES ('user_rich', 9223372036854775000)`)
	require.NoError(t, err)
	e.consume("c0")

	ok := func(id string, amount string) amqp.Publishing {
		return body(`{"eventId":"` + id + `","userId":"user_1","type":"PAYMENT_COMPLETED","amount":` + amount + `}`)
	}
	e.publishRaw(ok("evt_conflict", "100"))
	e.waitRows(1)

	old := ok("evt_old", "100")
	old.Timestamp = time.Now().Add(-31 * 24 * time.Hour)
	future := ok("evt_future", "100")
	future.Timestamp = time.Now().Add(365 * 24 * time.Hour)
	noTime := ok("evt_notime", "100")
	noTime.Timestamp = untimed
	pay := func(fields string) amqp.Publishing {
		return body(`{"eventId":"evt_f","userId":"user_1","type":"PAYMENT_COMPLETED","amount":1` + fields + `}`)
	}
	oldInBody := pay(`,"occurredAt":"` + time.Now().Add(-40*24*time.Hour).UTC().Format(time.RFC3339) + `"`)
	want := map[string]string{ // message id -> reason
		"m_json":     "invalid_json",
		"m_noid":     "invalid_event_id",
		"m_emptyid":  "invalid_event_id",
		"m_longid":   "invalid_event_id",
		"m_userint":  "invalid_field",
		"m_negative": "invalid_field",
		"m_fraction": "invalid_field",
		"m_type":     "unknown_type",
		"m_conflict": wire.ReasonPayloadConflict,
		"m_poison":   wire.ReasonHandlerFailed,
		"m_old":      wire.ReasonBeyondRetention,
		"m_binary":   "invalid_utf8",
		// The second hardening round.
		"m_future":    wire.ReasonFutureTimestamp,
		"m_notime":    wire.ReasonMissingTime,
		"m_oldinbody": wire.ReasonBeyondRetention,
		"m_badutf8":   "invalid_utf8",
		"m_surrogate": "invalid_utf8",
		"m_dupkey":    "duplicate_key",
		"m_wrongcase": "unknown_field",
		"m_unknown":   "unknown_field",
		"m_trailing":  "invalid_json",
		"m_nul":       "nul_character",
		"m_control":   "invalid_event_id",
		"m_overflow":  wire.ReasonNumericOverflow,
		"m_badtime":   "invalid_field",
	}
	msgs := map[string]amqp.Publishing{
		"m_json":     body(`{"eventId":`),
		"m_noid":     body(`{"userId":"user_1","type":"PAYMENT_COMPLETED","amount":1}`),
		"m_emptyid":  body(`{"eventId":"","userId":"user_1","type":"PAYMENT_COMPLETED","amount":1}`),
		"m_longid":   body(`{"eventId":"` + strings.Repeat("e", guard.MaxIDLen+1) + `","userId":"user_1","type":"PAYMENT_COMPLETED","amount":1}`),
		"m_userint":  body(`{"eventId":"evt_u","userId":42,"type":"PAYMENT_COMPLETED","amount":1}`),
		"m_negative": ok("evt_neg", "-5"),
		"m_fraction": ok("evt_frac", "10.5"),
		"m_type":     body(`{"eventId":"evt_t","userId":"user_1","type":"PAYMENT_STARTED","amount":1}`),
		"m_conflict": ok("evt_conflict", "200"),
		"m_poison":   body(`{"eventId":"evt_poison","userId":"user_poison","type":"PAYMENT_COMPLETED","amount":1}`),
		"m_old":      old,
		"m_binary":   {Body: []byte{0xff, 0x00, 0xfe}},

		"m_future":    future,
		"m_notime":    noTime,
		"m_oldinbody": oldInBody,
		"m_badutf8":   body("{\"eventId\":\"evt_b\",\"userId\":\"acct\xff\",\"type\":\"PAYMENT_COMPLETED\",\"amount\":1}"),
		"m_surrogate": body(`{"eventId":"evt_s","userId":"acct\ud800","type":"PAYMENT_COMPLETED","amount":1}`),
		"m_dupkey":    body(`{"eventId":"evt_d","userId":"user_1","userId":"user_2","type":"PAYMENT_COMPLETED","amount":1}`),
		"m_wrongcase": body(`{"EVENTID":"evt_w","userId":"user_1","type":"PAYMENT_COMPLETED","amount":1}`),
		"m_unknown":   pay(`,"currency":"EUR"`),
		"m_trailing":  pay(`}}`),
		"m_nul":       body(`{"eventId":"evt_n","userId":"acct\u0000","type":"PAYMENT_COMPLETED","amount":1}`),
		"m_control":   body(`{"eventId":"evt\u0007","userId":"user_1","type":"PAYMENT_COMPLETED","amount":1}`),
		"m_overflow":  body(`{"eventId":"evt_rich","userId":"user_rich","type":"PAYMENT_COMPLETED","amount":1000}`),
		"m_badtime":   pay(`,"occurredAt":"last tuesday"`),
	}
	var batch []amqp.Publishing
	for id, m := range msgs {
		m.MessageId = id
		batch = append(batch, m, ok("evt_after_"+id, "7"))
	}
	e.publishRaw(batch...)

	letters := e.deadLetters(len(want))
	got := map[string]string{}
	for _, d := range letters {
		reason, _ := d.Headers[wire.HeaderReason].(string)
		got[d.MessageId] = reason
		require.NotEmpty(t, d.Headers[wire.HeaderError], "dead letter %s carries no error text", d.MessageId)
		require.Equal(t, msgs[d.MessageId].Body, d.Body, "dead letter %s must keep the original body", d.MessageId)
		require.Equal(t, e.queue, d.Headers[wire.HeaderQueue])
		// Data errors are dead-lettered on the first attempt, not after N.
		if id := d.MessageId; id == "m_overflow" || id == "m_nul" {
			require.Equal(t, int64(1), d.Headers[wire.HeaderDeliveryCount], id)
		}
		// The event's time travels with its dead letter, for a replay.
		switch ts := msgs[d.MessageId].Timestamp; {
		case ts.Equal(untimed):
			require.True(t, d.Timestamp.IsZero(), d.MessageId)
		case !ts.IsZero():
			require.WithinDuration(t, ts, d.Timestamp, time.Second, d.MessageId)
		}
	}
	require.Equal(t, want, got)

	// The good events behind the bad ones were applied, once each.
	require.Eventually(t, func() bool { return e.ledgerRows() == 1+len(msgs) }, 30*time.Second, 20*time.Millisecond)
	rows, err := e.pool.Query(context.Background(), `SELECT event_id, amount FROM payments_ledger ORDER BY event_id`)
	require.NoError(t, err)
	var ids []string
	for rows.Next() {
		var id string
		var amount int64
		require.NoError(t, rows.Scan(&id, &amount))
		if id == "evt_conflict" {
			require.Equal(t, int64(100), amount, "the conflicting payload must not replace the first")
		}
		ids = append(ids, id)
	}
	require.NoError(t, rows.Err())
	var wantIDs []string
	for id := range msgs {
		wantIDs = append(wantIDs, "evt_after_"+id)
	}
	wantIDs = append(wantIDs, "evt_conflict")
	sort.Strings(wantIDs)
	require.Equal(t, wantIDs, ids)

	stats := e.stopAll()
	// A payload conflict is counted once, as its own outcome; the rest as
	// dead_lettered.
	require.Equal(t, int64(1), stats["payload_conflict"], "%v", stats)
	require.Equal(t, int64(len(want)-1), stats["dead_lettered"], "%v", stats)
	require.Equal(t, 0, testenv.QueueDepth(t, e.amqpURL, e.queue))
}
