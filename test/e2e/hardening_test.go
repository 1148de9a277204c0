package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/guard/guardtest"
)

func payment(id, user string, amount int) amqp.Publishing {
	return body(fmt.Sprintf(`{"eventId":%q,"userId":%q,"type":"PAYMENT_COMPLETED","amount":%d}`, id, user, amount))
}

// balance returns user's balance, or -1 if the user has none.
func (e *env) balance(user string) int64 {
	e.t.Helper()
	b := int64(-1)
	_ = e.pool.QueryRow(context.Background(), `SELECT balance FROM account_balances WHERE user_id = $1`, user).Scan(&b)
	return b
}

// TestNothingIsRetriedInPlaceForever: a handler whose query outlasts
// handler_timeout and a deferred constraint that fails at COMMIT used to be
// taken for "the store is down" and retried in place, never dead-lettered;
// with two of them per worker the consumer stopped doing useful work. Now
// each ends in the DLQ (the timeout after delivery_limit attempts, the
// constraint at once), and the good events behind them are applied.
func TestNothingIsRetriedInPlaceForever(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	e.vars = append(e.vars, "IDEM_CONSUMER_DELIVERY_LIMIT=2", "IDEM_CONSUMER_WORKERS=2", "IDEM_CONSUMER_PREFETCH=2", "IDEM_CONSUMER_BATCH_SIZE=2",
		// 2s, not 1s: after a timeout the consumer asks whether the store
		// answers within half of it, and on a loaded CI machine 500 ms was
		// once too short for a new connection (the event was then held as
		// the store's fault, which this test forbids).
		"IDEM_CONSUMER_HANDLER_TIMEOUT=2s")
	_, err := e.pool.Exec(context.Background(), `
		CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.user_id = 'user_slow' THEN PERFORM pg_sleep(5); END IF;
			RETURN NEW;
		END $$;
		CREATE TRIGGER slow BEFORE INSERT ON payments_ledger FOR EACH ROW EXECUTE FUNCTION slow();
		-- One payment per user, checked at COMMIT.
		CREATE TABLE once_per_user (user_id text, CONSTRAINT once UNIQUE (user_id) DEFERRABLE INITIALLY DEFERRED);
		CREATE FUNCTION once() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.user_id = 'user_once' THEN INSERT INTO once_per_user VALUES (NEW.user_id); END IF;
			RETURN NEW;
		END $$;
		CREATE TRIGGER once BEFORE INSERT ON payments_ledger FOR EACH ROW EXECUTE FUNCTION once();`)
	require.NoError(t, err)
	e.consume("c0")
	e.publishRaw(payment("evt_once_1", "user_once", 1))
	e.waitRows(1)

	msgs := map[string]amqp.Publishing{
		"m_slow_1": payment("evt_slow_1", "user_slow", 1),
		"m_slow_2": payment("evt_slow_2", "user_slow", 1),
		"m_once_2": payment("evt_once_2", "user_once", 1),
		"m_once_3": payment("evt_once_3", "user_once", 1),
	}
	var batch []amqp.Publishing
	for id, m := range msgs {
		m.MessageId = id
		batch = append(batch, m)
	}
	for i := range 20 {
		batch = append(batch, payment(fmt.Sprintf("evt_good_%d", i), "user_good", 1))
	}
	e.publishRaw(batch...)

	want := map[string]string{
		"m_slow_1": wire.ReasonHandlerTimeout, "m_slow_2": wire.ReasonHandlerTimeout,
		"m_once_2": wire.ReasonIntegrityViolation, "m_once_3": wire.ReasonIntegrityViolation,
	}
	wantAttempts := map[string]int64{"m_slow_1": 2, "m_slow_2": 2, "m_once_2": 1, "m_once_3": 1}
	got := map[string]string{}
	for _, d := range e.deadLetters(len(want)) {
		got[d.MessageId], _ = d.Headers[wire.HeaderReason].(string)
		require.Equal(t, wantAttempts[d.MessageId], d.Headers[wire.HeaderDeliveryCount], d.MessageId)
	}
	require.Equal(t, want, got)
	require.Eventually(t, func() bool { return e.balance("user_good") == 20 }, 30*time.Second, 20*time.Millisecond)
	require.Equal(t, int64(1), e.balance("user_once"))
	require.Equal(t, int64(-1), e.balance("user_slow"))
	stats := e.stopAll()
	require.Zero(t, stats["count/"+wire.CounterStoreRetry], "nothing here is the store's fault: %v", stats)
	require.Equal(t, int64(2), stats["retry/"+wire.ReasonHandlerTimeout], "%v", stats)
}

// TestPostgresOutageHoldsThenHandsBack: while Postgres is unreachable a
// delivery is retried in place (counted) for store_hold, then handed back to
// the queue rather than held for ever; nothing is dead-lettered or lost.
func TestPostgresOutageHoldsThenHandsBack(t *testing.T) {
	t.Parallel()
	testenv.Shared(t) // before its Postgres starts, not only in newEnv
	pg := testenv.StartPostgres(t)
	e := newEnvOn(t, "", "", pg.URL())
	e.vars = append(e.vars, "IDEM_CONSUMER_STORE_HOLD=1s", "IDEM_CONSUMER_WORKERS=1", "IDEM_CONSUMER_PREFETCH=1", "IDEM_CONSUMER_BATCH_SIZE=1")
	c := e.consume("c0")
	e.waitConsuming(c)
	pg.Stop()
	e.publishRaw(payment("evt_held", "user_1", 5))
	e.waitLog("handing the delivery back")
	pg.Start()
	e.pool.Reset() // its connections died with the server
	e.waitRows(1)
	stats := e.stopAll()
	require.Positive(t, stats["count/"+wire.CounterStoreRetry], "%v", stats)
	require.Positive(t, stats["retry/"+wire.RequeueStoreUnavailable], "%v", stats)
	require.Zero(t, stats["dead_lettered"], "%v", stats)
	require.Equal(t, int64(5), e.balance("user_1"))
}

// TestReplayHorizonCannotBeBypassed: after a prune, the same event comes
// back without a timestamp, with one a year ahead, and with an old
// occurredAt under a fresh AMQP timestamp. None may be applied again, and
// prune may not cut below the retention the consumers enforce.
func TestReplayHorizonCannotBeBypassed(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	e.vars = append(e.vars, "IDEM_REDIS_ENABLED=false") // Postgres alone decides
	c := e.consume("c0")
	e.waitConsuming(c)
	e.publishRaw(payment("evt_h", "user_h", 100))
	e.waitRows(1)

	// A prune with a retention shorter than the consumers enforce is refused.
	out, err := e.idem("prune", "--batch", "10")
	require.NoError(t, err, out)
	short := e.run([]string{"IDEM_POSTGRES_RETENTION=24h"}, "prune")
	require.Equal(t, 1, short.code, short.out)
	require.Contains(t, short.out, "consumers enforce 720h")

	// The row ages past the retention and is pruned.
	_, err = e.pool.Exec(context.Background(), `UPDATE idem_processed SET processed_at = now() - interval '40 days'`)
	require.NoError(t, err)
	out, err = e.idem("prune", "--batch", "10")
	require.NoError(t, err, out)
	require.Contains(t, out, "pruned 1 dedup rows")

	noTime := payment("evt_h", "user_h", 100)
	noTime.MessageId, noTime.Timestamp = "m_notime", untimed
	future := payment("evt_h", "user_h", 100)
	future.MessageId, future.Timestamp = "m_future", time.Now().Add(365*24*time.Hour)
	oldBody := body(`{"eventId":"evt_h","userId":"user_h","type":"PAYMENT_COMPLETED","amount":100,"occurredAt":"` +
		time.Now().Add(-40*24*time.Hour).UTC().Format(time.RFC3339) + `"}`)
	oldBody.MessageId = "m_oldbody" // with a fresh AMQP timestamp: the body's time wins
	e.publishRaw(noTime, future, oldBody)
	got := map[string]string{}
	for _, d := range e.deadLetters(3) {
		got[d.MessageId], _ = d.Headers[wire.HeaderReason].(string)
	}
	require.Equal(t, map[string]string{
		"m_notime": wire.ReasonMissingTime, "m_future": wire.ReasonFutureTimestamp, "m_oldbody": wire.ReasonBeyondRetention,
	}, got)
	require.Equal(t, int64(100), e.balance("user_h"), "a replay past the horizon was applied again")
	require.Equal(t, 1, e.ledgerRows())

	// A consumer started after the prune learns where it cut.
	var prunedThrough time.Time
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT pruned_through FROM idem_horizon`).Scan(&prunedThrough))
	require.WithinDuration(t, time.Now().Add(-720*time.Hour-5*time.Minute), prunedThrough, time.Minute)
}

// TestDeadLetterIsNeverLost deletes the dead-letter queue under a running
// consumer. A dead letter that no queue takes must not be acked away: the
// consumer re-declares the queue, the delivery comes back, and the dead
// letter lands.
func TestDeadLetterIsNeverLost(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	c := e.consume("c0")
	e.waitConsuming(c)
	ch := e.channel()
	// A first dead letter lands once the publishing connection is open
	// (it opens beside the session and declares the DLQ): deleting the DLQ
	// before that had the connection re-declare it, and m_bad land without
	// ever being returned.
	require.NoError(t, ch.PublishWithContext(context.Background(), "", e.queue, false, false, amqp.Publishing{
		MessageId: "m_first", Body: []byte(`{"eventId":`), Timestamp: time.Now(), DeliveryMode: amqp.Persistent,
	}))
	require.Eventually(t, func() bool { return testenv.QueueDepth(t, e.amqpURL, e.queue+".dlq") == 1 },
		30*time.Second, 20*time.Millisecond, "the first dead letter never landed")
	_, err := ch.QueueDelete(e.queue+".dlq", false, false, false)
	require.NoError(t, err)
	require.Equal(t, -1, testenv.QueueDepth(t, e.amqpURL, e.queue+".dlq"), "the DLQ must be gone")
	// Published directly: publishRaw would re-declare the DLQ first.
	require.NoError(t, ch.PublishWithContext(context.Background(), "", e.queue, false, false, amqp.Publishing{
		MessageId: "m_bad", Body: []byte(`{"eventId":`), Timestamp: time.Now(), DeliveryMode: amqp.Persistent,
	}))
	// The consumer re-declares the DLQ; wait for the letter there (a get
	// on a quorum queue still electing its leader fails).
	require.Eventually(t, func() bool { return testenv.QueueDepth(t, e.amqpURL, e.queue+".dlq") == 1 },
		30*time.Second, 20*time.Millisecond, "the dead letter never reached a re-declared DLQ")
	letters := e.deadLetters(1)
	require.Equal(t, "m_bad", letters[0].MessageId)
	require.Equal(t, "invalid_json", letters[0].Headers[wire.HeaderReason])
	stats := e.stopAll()
	require.Positive(t, stats["retry/"+wire.RequeueUnroutable], "the dead letter was never returned: %v", stats)
	require.Equal(t, stats["retry/"+wire.RequeueUnroutable], stats["count/"+wire.CounterDeadLetterReturned], "%v", stats)
	require.Equal(t, int64(2), stats["dead_lettered"], "m_first and m_bad: %v", stats)
}

// TestBrokerCountersAreTheBrokers: a publisher-set x-delivery-count must not
// spend a message's budget, and a replay of a dead letter (headers copied,
// as an operator's shovel would) starts with a fresh budget.
func TestBrokerCountersAreTheBrokers(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	e.vars = append(e.vars, "IDEM_CONSUMER_DELIVERY_LIMIT=3")
	e.poisonLedger()
	e.consume("c0")
	forged := payment("evt_forged", "user_poison", 1)
	forged.Headers = amqp.Table{"x-delivery-count": int64(7), "x-trace": "abc"}
	e.publishRaw(forged)
	d := e.deadLetters(1)[0]
	require.Equal(t, wire.ReasonHandlerFailed, d.Headers[wire.HeaderReason])
	require.Equal(t, int64(3), d.Headers[wire.HeaderDeliveryCount], "a forged header spent the budget")
	require.Equal(t, "abc", d.Headers["x-trace"], "dead letters keep the producer's headers")

	replay := amqp.Publishing{Headers: d.Headers, Body: d.Body, MessageId: "m_replay", Timestamp: d.Timestamp}
	e.publishRaw(replay)
	again := e.deadLetters(1)[0]
	require.Equal(t, "m_replay", again.MessageId)
	require.Equal(t, int64(3), again.Headers[wire.HeaderDeliveryCount], "a replay starts with a fresh budget")
}

// TestOddEventIDsEndToEnd: IDs real producers send (slashes, pipes, braces,
// quotes, non-Latin scripts, SQL) are processed once, through Redis keys and
// Postgres rows, duplicates included.
func TestOddEventIDsEndToEnd(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	c := e.consume("c0")
	var msgs []amqp.Publishing
	for _, id := range guardtest.OddEventIDs {
		msgs = append(msgs, body(string(payments.Event{EventID: id, UserID: "user_odd", Type: payments.TypePaymentCompleted, Amount: 1}.Marshal())))
	}
	e.publishRaw(msgs...)
	n := len(guardtest.OddEventIDs)
	require.Eventually(t, func() bool { return e.balance("user_odd") == int64(n) }, 30*time.Second, 20*time.Millisecond)
	// The copies come after their originals committed, so that they are
	// caught by the originals' Redis keys (or Postgres rows), not inside
	// a batch.
	e.publishRaw(msgs...)
	require.Eventually(t, func() bool {
		st, err := c.Stats()
		return err == nil && st["duplicate_redis"]+st["duplicate_postgres"] == int64(n)
	}, 30*time.Second, 50*time.Millisecond)
	stats := e.stopAll()
	require.Equal(t, int64(n), stats["processed"], "%v", stats)
	require.Equal(t, int64(n), stats["duplicate_redis"]+stats["duplicate_postgres"], "%v", stats)
	require.Zero(t, stats["dead_lettered"], "%v", stats)
	rows, err := e.pool.Query(context.Background(), `SELECT event_id FROM payments_ledger ORDER BY event_id`)
	require.NoError(t, err)
	var ids []string
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		ids = append(ids, id)
	}
	require.ElementsMatch(t, guardtest.OddEventIDs, ids)
}
