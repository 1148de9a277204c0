package idem_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/idem"
	"github.com/idemhq/idem/pkg/outbox"
)

// sender records each event (its AMQP message ID) in the ledger and sends
// one message through the outbox To the destination its body names.
type sender struct{}

func (sender) Decode(m consumer.Message) (guard.Event, [2]string, error) {
	return guard.Event{ID: m.ID, Hash: guard.HashFields(string(m.Body)), Time: time.Now()}, [2]string{m.ID, string(m.Body)}, nil
}

func (sender) Apply(ctx context.Context, tx pgx.Tx, v [2]string) error {
	if _, err := tx.Exec(ctx, `INSERT INTO ledger (event_id, user_id, amount) VALUES ($1, 'u', 1)`, v[0]); err != nil {
		return err
	}
	return outbox.Enqueue(ctx, tx, outbox.Message{EventID: v[0], To: v[1], Key: v[0], Body: []byte(`{"event":"` + v[0] + `"}`)})
}

// receiver is an HTTP API that wants a bearer token, and acts on each
// Idempotency-Key once.
type receiver struct {
	token string
	mu    sync.Mutex
	acted map[string]int // by Idempotency-Key: requests acted on
	seen  map[string]int // by Idempotency-Key: every request with the token
	bad   int            // requests without it
}

func startReceiver(t *testing.T, token string) (*receiver, *httptest.Server) {
	rcv := &receiver{token: token, acted: map[string]int{}, seen: map[string]int{}}
	srv := httptest.NewServer(rcv)
	t.Cleanup(srv.Close)
	return rcv, srv
}

func (rcv *receiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rcv.mu.Lock()
	defer rcv.mu.Unlock()
	if r.Header.Get("Authorization") != "Bearer "+rcv.token {
		rcv.bad++
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	key := r.Header.Get("Idempotency-Key")
	rcv.seen[key]++
	if rcv.seen[key] == 1 && len(rcv.seen)%4 == 0 {
		w.WriteHeader(http.StatusServiceUnavailable) // a quarter fail once: sent again, same key
		return
	}
	if rcv.acted[key] == 0 {
		rcv.acted[key]++
	}
}

func (rcv *receiver) counts() (acted map[string]int, requests, bad int) {
	rcv.mu.Lock()
	defer rcv.mu.Unlock()
	acted = map[string]int{}
	for k, n := range rcv.acted {
		acted[k] = n
	}
	for _, n := range rcv.seen {
		requests += n
	}
	return acted, requests, rcv.bad
}

// sendTo publishes one message per id, with that AMQP message ID and
// body, each confirmed, once the service has declared queue.
func sendTo(t *testing.T, amqpURL, queue, body string, ids ...string) {
	t.Helper()
	conn, err := amqp.Dial(amqpURL)
	require.NoError(t, err)
	defer conn.Close()
	require.Eventually(t, func() bool {
		ch, err := conn.Channel()
		require.NoError(t, err)
		defer ch.Close()
		_, err = ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		return err == nil
	}, 30*time.Second, 20*time.Millisecond, "the service never declared its queue")
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, id := range ids {
		for acked := false; !acked; { // a queue just declared may nack a moment
			c, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false,
				amqp.Publishing{MessageId: id, Body: []byte(body), Timestamp: time.Now()})
			require.NoError(t, err)
			acked, err = c.WaitContext(ctx)
			require.NoError(t, err)
		}
	}
}

// fastRelay is relay tuning for tests: failed rows retried within
// milliseconds.
func fastRelay(dests map[string]outbox.Destination) outbox.RelayConfig {
	return outbox.RelayConfig{Destinations: dests, PollInterval: 50 * time.Millisecond,
		BackoffMin: 10 * time.Millisecond, BackoffMax: 50 * time.Millisecond}
}

func countRows(t *testing.T, db *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

// runUntilStopped runs svc until stop (or the test's end), which returns
// Run's error.
func runUntilStopped(t *testing.T, svc *idem.Service[[2]string]) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() { cancel(); err = <-done })
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

func readyz(svc *idem.Service[[2]string]) (int, string) {
	rec := httptest.NewRecorder()
	svc.Health().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
	return rec.Code, rec.Body.String()
}

// TestTheServiceRelaysItsOutboxToAnAPIThatWantsAHeader: destinations
// declared in Go, no second process and no environment: Run relays the
// handler's messages to an HTTP API that refuses a request without its
// bearer token. Every event's message arrives with the token, the API acts
// on each message ID once (a quarter of them fail once and come again with
// the same key), every row ends sent, and /readyz reports the relay.
func TestTheServiceRelaysItsOutboxToAnAPIThatWantsAHeader(t *testing.T) {
	t.Parallel()
	db, dbURL := testenv.Schema(t, testenv.Effects)
	amqpURL := testenv.AMQPURL()
	queue := testenv.Queue(t, amqpURL)
	rcv, srv := startReceiver(t, "t0ken")
	reg := prometheus.NewRegistry()
	svc, err := idem.New(idem.Config{Scope: "pay", DatabaseURL: dbURL,
		Consumer: consumer.Config{URL: amqpURL, Queue: queue},
		Outbox: fastRelay(map[string]outbox.Destination{
			"api": {URL: srv.URL + "/v1/notes", Header: http.Header{"Authorization": {"Bearer t0ken"}}},
		}),
		Metrics: reg, Logger: testenv.Logger(t)}, sender{})
	require.NoError(t, err)
	stop := runUntilStopped(t, svc)

	const n = 40
	var ids []string
	for i := range n {
		ids = append(ids, fmt.Sprintf("e%02d", i))
	}
	sendTo(t, amqpURL, queue, "api", ids...)
	sendTo(t, amqpURL, queue, "api", ids[:n/2]...) // redelivered: applied once, sent once
	require.Eventually(t, func() bool {
		return countRows(t, db, `SELECT count(*) FROM idem_outbox WHERE state = 'sent'`) == n
	}, 30*time.Second, 20*time.Millisecond, "the relay never sent every row")

	acted, requests, bad := rcv.counts()
	require.Len(t, acted, n)
	for _, id := range ids {
		require.Equal(t, 1, acted[outbox.ID("pay", id, 0)], "message of %s", id)
	}
	require.Zero(t, bad, "a request came without the token")
	require.GreaterOrEqual(t, requests, n+n/4, "the failed requests were sent again")
	require.Equal(t, n, countRows(t, db, `SELECT count(*) FROM ledger`))
	require.Zero(t, countRows(t, db, `SELECT count(*) FROM idem_outbox WHERE state <> 'sent'`))

	code, body := readyz(svc)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "relay: ok\n")
	require.Contains(t, body, "outbox: ok\n")
	mfs, err := reg.Gather()
	require.NoError(t, err)
	var sent float64
	for _, mf := range mfs {
		if mf.GetName() == "idem_outbox_attempts_total" {
			for _, m := range mf.GetMetric() {
				if m.GetLabel()[0].GetValue() == "api" && m.GetLabel()[1].GetValue() == "sent" {
					sent = m.GetCounter().GetValue()
				}
			}
		}
	}
	require.EqualValues(t, n, sent, "the relay's metrics are on the service's registry")

	require.NoError(t, stop())
}

// TestAMessageToAnUndeclaredDestinationFailsItsEvent: the service declares
// "api"; a handler that sends To "billing" gets Enqueue's error inside its
// transaction, naming both. Nothing of that event commits (no ledger row,
// no outbox row that no relay could send); it is retried and then
// dead-lettered with the error, and the events around it go on.
func TestAMessageToAnUndeclaredDestinationFailsItsEvent(t *testing.T) {
	t.Parallel()
	db, dbURL := testenv.Schema(t, testenv.Effects)
	amqpURL := testenv.AMQPURL()
	queue := testenv.Queue(t, amqpURL)
	_, srv := startReceiver(t, "t0ken")
	svc, err := idem.New(idem.Config{Scope: "pay", DatabaseURL: dbURL,
		Consumer: consumer.Config{URL: amqpURL, Queue: queue, DeliveryLimit: 2,
			RetryBackoff: consumer.Backoff{Min: 10 * time.Millisecond, Max: 50 * time.Millisecond}},
		Outbox: fastRelay(map[string]outbox.Destination{
			"api": {URL: srv.URL, Header: http.Header{"Authorization": {"Bearer t0ken"}}},
		}),
		Logger: testenv.Logger(t)}, sender{})
	require.NoError(t, err)
	runUntilStopped(t, svc)

	sendTo(t, amqpURL, queue, "api", "before")
	sendTo(t, amqpURL, queue, "billing", "stray")
	sendTo(t, amqpURL, queue, "api", "after")

	var letter amqp.Delivery
	conn, err := amqp.Dial(amqpURL)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		d, ok, err := ch.Get(queue+".dlq", true)
		require.NoError(t, err)
		letter = d
		return ok
	}, 30*time.Second, 20*time.Millisecond, "the event was never dead-lettered")
	require.Equal(t, "stray", letter.MessageId)
	require.Equal(t, wire.ReasonHandlerFailed, letter.Headers[wire.HeaderReason])
	msg := fmt.Sprint(letter.Headers[wire.HeaderError])
	require.Contains(t, msg, `To "billing" is not one of the service's destinations ("api")`)

	require.Eventually(t, func() bool {
		return countRows(t, db, `SELECT count(*) FROM idem_outbox WHERE state = 'sent'`) == 2
	}, 30*time.Second, 20*time.Millisecond, "the events around it were not relayed")
	require.Zero(t, countRows(t, db, `SELECT count(*) FROM ledger WHERE event_id = 'stray'`), "its effect committed")
	require.Zero(t, countRows(t, db, `SELECT count(*) FROM idem_outbox WHERE event_id = 'stray'`), "its message was stored")
	require.Zero(t, countRows(t, db, `SELECT count(*) FROM idem_processed WHERE event_id = 'stray'`), "it was marked processed")
	require.Equal(t, 2, countRows(t, db, `SELECT count(*) FROM ledger`))
}

// TestNoRelayRunsNone: with NoRelay the service declares its destinations
// (Enqueue still checks them) and relays nothing: its messages wait in the
// outbox for another process's relay, the API hears nothing, and /readyz
// has no relay line.
func TestNoRelayRunsNone(t *testing.T) {
	t.Parallel()
	db, dbURL := testenv.Schema(t, testenv.Effects)
	amqpURL := testenv.AMQPURL()
	queue := testenv.Queue(t, amqpURL)
	rcv, srv := startReceiver(t, "t0ken")
	svc, err := idem.New(idem.Config{Scope: "pay", DatabaseURL: dbURL,
		Consumer: consumer.Config{URL: amqpURL, Queue: queue},
		Outbox: fastRelay(map[string]outbox.Destination{
			"api": {URL: srv.URL, Header: http.Header{"Authorization": {"Bearer t0ken"}}},
		}),
		NoRelay: true,
		Logger:  testenv.Logger(t)}, sender{})
	require.NoError(t, err)
	runUntilStopped(t, svc)

	sendTo(t, amqpURL, queue, "api", "e1")
	require.Eventually(t, func() bool {
		return countRows(t, db, `SELECT count(*) FROM idem_outbox WHERE state = 'pending'`) == 1
	}, 30*time.Second, 20*time.Millisecond, "the event's message was never enqueued")
	require.Never(t, func() bool {
		_, requests, bad := rcv.counts()
		return requests+bad > 0 || countRows(t, db, `SELECT count(*) FROM idem_outbox WHERE state <> 'pending'`) > 0
	}, 1500*time.Millisecond, 50*time.Millisecond, "a relay ran")
	code, body := readyz(svc)
	require.Equal(t, http.StatusOK, code, body)
	require.NotContains(t, body, "relay")
	require.False(t, strings.Contains(body, "outbox"), body)
}
