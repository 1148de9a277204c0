package relay_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/outbox"
)

// receiver is an HTTP destination that records every request by its
// Idempotency-Key and answers with the status answer returns.
type receiver struct {
	mu     sync.Mutex
	seen   map[string]int
	order  []string // keys in arrival order
	answer func(key string, n int) int
	body   func(key string) string // the answer's body; nil: none
}

func newReceiver(t *testing.T, answer func(key string, n int) int) (*receiver, string) {
	r := &receiver{seen: map[string]int{}, answer: answer}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		key := req.Header.Get("Idempotency-Key")
		r.mu.Lock()
		r.seen[key]++
		n := r.seen[key]
		r.order = append(r.order, string(body))
		r.mu.Unlock()
		w.WriteHeader(r.answer(key, n))
		if r.body != nil {
			_, _ = io.WriteString(w, r.body(key))
		}
	}))
	t.Cleanup(srv.Close)
	return r, srv.URL
}

func (r *receiver) count() map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]int{}
	for k, v := range r.seen {
		out[k] = v
	}
	return out
}

// send commits event id's effect-free claim with msgs, through a guard.
func send(t *testing.T, g *guard.Guard, id string, msgs ...outbox.Message) {
	t.Helper()
	out, err := g.Process(context.Background(), guard.Event{ID: id, Hash: guard.HashFields(id)}, func(ctx context.Context, tx pgx.Tx) error {
		return outbox.Enqueue(ctx, tx, msgs...)
	})
	require.NoError(t, err)
	require.Equal(t, guard.OutcomeProcessed, out)
}

func newGuard(t *testing.T, db *pgxpool.Pool) *guard.Guard {
	g, err := guard.New(guard.Config{Scope: "pay", Store: pgtier.New(db)})
	require.NoError(t, err)
	return g
}

func run(t *testing.T, cfg relay.Config) *relay.Relay {
	t.Helper()
	if cfg.PollInterval == 0 {
		cfg.PollInterval = 50 * time.Millisecond
	}
	if cfg.BackoffMin == 0 {
		cfg.BackoffMin, cfg.BackoffMax = 10*time.Millisecond, 50*time.Millisecond
	}
	r, err := relay.New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = r.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return r
}

func states(t *testing.T, db *pgxpool.Pool) map[string]int {
	t.Helper()
	rows, err := db.Query(context.Background(), `SELECT state, count(*) FROM idem_outbox GROUP BY state`)
	require.NoError(t, err)
	out := map[string]int{}
	for rows.Next() {
		var s string
		var n int
		require.NoError(t, rows.Scan(&s, &n))
		out[s] = n
	}
	return out
}

func TestEnqueueOnlyInsideAnApplyAndForItsEvents(t *testing.T) {
	db, _ := testenv.Schema(t)
	ctx := context.Background()
	tx, err := db.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	err = outbox.Enqueue(ctx, tx, outbox.Message{EventID: "e1", To: "x"})
	require.ErrorContains(t, err, "outside a guard's apply")

	g := newGuard(t, db)
	_, err = g.Process(ctx, guard.Event{ID: "e1", Hash: guard.HashFields("e1")}, func(ctx context.Context, tx pgx.Tx) error {
		return outbox.Enqueue(ctx, tx, outbox.Message{EventID: "e2", To: "x"})
	})
	require.ErrorContains(t, err, "does not apply that event")

	_, err = g.Process(ctx, guard.Event{ID: "e3", Hash: guard.HashFields("e3")}, func(ctx context.Context, tx pgx.Tx) error {
		return outbox.Enqueue(ctx, tx, outbox.Message{EventID: "e3", To: "x"}, outbox.Message{EventID: "e3", To: "y"})
	})
	require.ErrorContains(t, err, "23505", "the same index twice is the same message")
	require.Equal(t, map[string]int{}, states(t, db), "a failed apply leaves no row")
}

func TestMessageIDsAreDeterministicAndDistinct(t *testing.T) {
	require.Equal(t, outbox.ID("pay", "e1", 0), outbox.ID("pay", "e1", 0))
	ids := map[string]bool{}
	for _, id := range []string{outbox.ID("pay", "e1", 0), outbox.ID("pay", "e1", 1), outbox.ID("pay", "e10", 0), outbox.ID("pa", "ye1", 0)} {
		require.Len(t, id, 32)
		require.NoError(t, guard.ValidateID(id))
		ids[id] = true
	}
	require.Len(t, ids, 4)
}

// take reads messages from queues until it has n, or 20s pass, then for
// 200ms more to see any extra.
func take(t *testing.T, n int, queues ...string) []amqp.Delivery {
	t.Helper()
	conn, err := amqp.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	var out []amqp.Delivery
	deadline := time.Now().Add(20 * time.Second)
	quietSince := time.Time{}
	for time.Now().Before(deadline) {
		got := false
		for _, q := range queues {
			d, ok, err := ch.Get(q, true)
			require.NoError(t, err)
			if ok {
				out, got = append(out, d), true
			}
		}
		switch {
		case got:
			quietSince = time.Time{}
		case len(out) >= n && quietSince.IsZero():
			quietSince = time.Now()
		case len(out) >= n && time.Since(quietSince) > 200*time.Millisecond:
			return out
		default:
			time.Sleep(10 * time.Millisecond)
		}
	}
	return out
}

func declare(t *testing.T, queue string, partitions int) broker.Topology {
	t.Helper()
	top := broker.TopologyFor(queue, 0)
	top.Partitions = partitions
	conn, err := amqp.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, top.Declare(ch))
	t.Cleanup(func() {
		for _, q := range top.Queues() {
			_ = sandbox.DeleteQueue(testenv.AMQPURL(), q)
		}
	})
	return top
}

func amqpDest(t *testing.T, spec string) map[string]relay.Destination {
	t.Helper()
	d, err := relay.ParseDestinations(spec)
	require.NoError(t, err)
	return d
}

func TestTheRelayPublishesEachMessageToItsDestination(t *testing.T) {
	db, _ := testenv.Schema(t)
	top := declare(t, testenv.Queue(t, testenv.AMQPURL()), 2)
	rcv, url := newReceiver(t, func(string, int) int { return http.StatusOK })
	g := newGuard(t, db)
	for i := range 10 {
		id := fmt.Sprintf("e%d", i)
		send(t, g, id,
			outbox.Message{EventID: id, To: "receipts", Key: fmt.Sprintf("u%d", i%3), Type: "RECEIPT_REQUESTED", Body: []byte(fmt.Sprintf(`{"n":%d}`, i))},
			outbox.Message{EventID: id, Index: 1, To: "mailer", Body: []byte(id)})
	}
	run(t, relay.Config{DB: db, AMQPURLs: []string{testenv.AMQPURL()}, Retention: time.Hour,
		Destinations: amqpDest(t, fmt.Sprintf("receipts=queue:%s/2 mailer=%s", top.Queue, url))})

	got := take(t, 10, top.Queues()...)
	require.Len(t, got, 10)
	for _, d := range got {
		var n int
		_, err := fmt.Sscanf(string(d.Body), `{"n":%d}`, &n)
		require.NoError(t, err)
		id := fmt.Sprintf("e%d", n)
		require.Equal(t, outbox.ID("pay", id, 0), d.MessageId)
		require.Equal(t, "RECEIPT_REQUESTED", d.Type)
		require.Equal(t, uint8(amqp.Persistent), d.DeliveryMode)
		require.Equal(t, top.QueueFor(fmt.Sprintf("u%d", n%3)), d.RoutingKey, "routed by key to its partition")
	}
	require.Eventually(t, func() bool { return states(t, db)["sent"] == 20 }, 10*time.Second, 20*time.Millisecond)
	seen := rcv.count()
	require.Len(t, seen, 10)
	for i := range 10 {
		require.Equal(t, 1, seen[outbox.ID("pay", fmt.Sprintf("e%d", i), 1)])
	}
}

// A cursor (id > last published) skips a row whose transaction took its id
// first and committed last. The relay reads by state, so it publishes it.
func TestARowCommittedLateIsNotSkipped(t *testing.T) {
	db, _ := testenv.Schema(t)
	top := declare(t, testenv.Queue(t, testenv.AMQPURL()), 1)
	g := newGuard(t, db)
	ctx := context.Background()

	inserted, release := make(chan struct{}), make(chan struct{})
	lateDone := make(chan error, 1)
	go func() {
		_, err := g.Process(ctx, guard.Event{ID: "late", Hash: guard.HashFields("late")}, func(ctx context.Context, tx pgx.Tx) error {
			if err := outbox.Enqueue(ctx, tx, outbox.Message{EventID: "late", To: "q", Key: "k", Body: []byte("late")}); err != nil {
				return err
			}
			close(inserted)
			<-release
			return nil
		})
		lateDone <- err
	}()
	<-inserted
	send(t, g, "early", outbox.Message{EventID: "early", To: "q", Key: "k", Body: []byte("early")})
	run(t, relay.Config{DB: db, AMQPURLs: []string{testenv.AMQPURL()}, Destinations: amqpDest(t, "q=queue:"+top.Queue)})
	got := take(t, 1, top.Queue)
	require.Len(t, got, 1)
	require.Equal(t, "early", string(got[0].Body))

	close(release)
	require.NoError(t, <-lateDone)
	got = take(t, 1, top.Queue)
	require.Len(t, got, 1, "the row that took the lower id and committed later is published too")
	require.Equal(t, "late", string(got[0].Body))
}

func TestOneKeysMessagesLeaveInOrder(t *testing.T) {
	db, _ := testenv.Schema(t)
	top := declare(t, testenv.Queue(t, testenv.AMQPURL()), 1)
	g := newGuard(t, db)
	const n = 300
	for i := range n {
		id := fmt.Sprintf("e%03d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "q", Key: fmt.Sprintf("u%d", i%4), Body: []byte(id)})
	}
	// Two relays with small batches share the lanes.
	for range 2 {
		run(t, relay.Config{DB: db, AMQPURLs: []string{testenv.AMQPURL()}, BatchSize: 7, LanesPerPass: 1,
			Destinations: amqpDest(t, "q=queue:"+top.Queue)})
	}
	got := take(t, n, top.Queue)
	require.Len(t, got, n)
	last := map[string]string{}
	for _, d := range got {
		var i int
		_, err := fmt.Sscanf(string(d.Body), "e%03d", &i)
		require.NoError(t, err)
		key := fmt.Sprintf("u%d", i%4)
		require.Less(t, last[key], string(d.Body), "key %s", key)
		last[key] = string(d.Body)
	}
}

func TestAFailingRowGoesDeadWithItsReasonAndReplays(t *testing.T) {
	db, _ := testenv.Schema(t)
	var broken sync.Map // key -> status to answer
	rcv, url := newReceiver(t, func(key string, _ int) int {
		if s, ok := broken.Load(key); ok {
			return s.(int)
		}
		return http.StatusOK
	})
	g := newGuard(t, db)
	bad, flaky := outbox.ID("pay", "bad", 0), outbox.ID("pay", "flaky", 0)
	broken.Store(bad, http.StatusUnprocessableEntity) // will never pass: dead at once
	broken.Store(flaky, http.StatusServiceUnavailable)
	for _, id := range []string{"bad", "flaky", "gone"} {
		to := "mailer"
		if id == "gone" {
			to = "nowhere"
		}
		send(t, g, id, outbox.Message{EventID: id, To: to, Body: []byte(id)})
	}
	run(t, relay.Config{DB: db, MaxAttempts: 3, Retention: time.Hour, Destinations: amqpDest(t, "mailer="+url)})
	require.Eventually(t, func() bool { return states(t, db)["dead"] == 3 }, 10*time.Second, 20*time.Millisecond)
	seen := rcv.count()
	require.Equal(t, 1, seen[bad], "a 422 is not tried again")
	require.Equal(t, 3, seen[flaky], "a 503 is tried MaxAttempts times")

	dead, err := relay.List(context.Background(), db, relay.Filter{State: "dead"})
	require.NoError(t, err)
	reasons := map[string]string{}
	for _, m := range dead {
		reasons[m.EventID] = m.LastError
	}
	require.Contains(t, reasons["bad"], "http 422")
	require.Contains(t, reasons["flaky"], "http 503")
	require.Contains(t, reasons["gone"], `no destination "nowhere"`)

	broken.Delete(flaky)
	n, err := relay.Replay(context.Background(), db, []int64{dead[1].ID})
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	require.Eventually(t, func() bool { return rcv.count()[flaky] == 4 && states(t, db)["sent"] == 1 }, 10*time.Second, 20*time.Millisecond)
}

func TestAReturnedMessageIsNotSent(t *testing.T) {
	db, _ := testenv.Schema(t)
	g := newGuard(t, db)
	send(t, g, "e1", outbox.Message{EventID: "e1", To: "q", Body: []byte("x")})
	run(t, relay.Config{DB: db, AMQPURLs: []string{testenv.AMQPURL()}, MaxAttempts: 2,
		Destinations: amqpDest(t, "q=queue:idem.test.no-such-queue-"+testenv.Name(t))})
	require.Eventually(t, func() bool { return states(t, db)["dead"] == 1 }, 10*time.Second, 20*time.Millisecond)
	dead, err := relay.List(context.Background(), db, relay.Filter{State: "dead"})
	require.NoError(t, err)
	require.Contains(t, dead[0].LastError, "NO_ROUTE")
	require.Equal(t, 2, dead[0].Attempts)
}

func TestParseDestinationsRefusesWhatItCannotReach(t *testing.T) {
	d, err := relay.ParseDestinations("a=queue:q/4 b=exchange:x/rk c=exchange:x d=https://u:secret@api.example.com/v1")
	require.NoError(t, err)
	require.Equal(t, 4, d["a"].Stream.Partitions)
	require.Equal(t, "rk", d["b"].RoutingKey)
	require.NotContains(t, d["d"].String(), "secret")
	for _, bad := range []string{"a", "a=", "=queue:q", "a=queue:", "a=queue:q/0", "a=exchange:", "a=ftp://x", "a=http://", "a=queue:q a=queue:r"} {
		_, err := relay.ParseDestinations(bad)
		require.Error(t, err, bad)
	}
}

func TestAnExchangeDestinationAndADoneStatus(t *testing.T) {
	db, _ := testenv.Schema(t)
	queue := testenv.Queue(t, testenv.AMQPURL())
	top := declare(t, queue, 1)
	exchange := "idem.test.x." + testenv.Name(t)
	conn, err := amqp.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.ExchangeDeclare(exchange, amqp.ExchangeDirect, false, true, false, false, nil))
	require.NoError(t, ch.QueueBind(top.Queue, "user_7", exchange, false, nil))
	// An API that already did every key: it answers 409, which this one
	// means as "done".
	rcv, url := newReceiver(t, func(string, int) int { return http.StatusConflict })
	g := newGuard(t, db)
	send(t, g, "e1",
		outbox.Message{EventID: "e1", To: "x", Key: "user_7", Body: []byte("by key")},
		outbox.Message{EventID: "e1", Index: 1, To: "api", Body: []byte("done before")})
	run(t, relay.Config{DB: db, AMQPURLs: []string{testenv.AMQPURL()}, DoneStatus: http.StatusConflict, Retention: time.Hour,
		Destinations: amqpDest(t, "x=exchange:"+exchange+" api="+url)})
	got := take(t, 1, top.Queue)
	require.Len(t, got, 1)
	require.Equal(t, "by key", string(got[0].Body), "no routing key: the message's key routes it")
	require.Eventually(t, func() bool { return states(t, db)["sent"] == 2 }, 10*time.Second, 20*time.Millisecond)
	require.Equal(t, 1, rcv.count()[outbox.ID("pay", "e1", 1)])
}

func TestSentRowsAreDeletedAfterTheirRetention(t *testing.T) {
	db, _ := testenv.Schema(t)
	g := newGuard(t, db)
	for i := range 2500 {
		id := fmt.Sprintf("e%d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "q", Body: []byte(id)})
	}
	ctx := context.Background()
	_, err := db.Exec(ctx, `UPDATE idem_outbox SET state = 'sent', sent_at = now() - CASE WHEN id % 5 = 0 THEN interval '1 minute' ELSE interval '2 hours' END`)
	require.NoError(t, err)
	n, err := relay.DeleteSent(ctx, db, time.Hour)
	require.NoError(t, err)
	require.EqualValues(t, 2000, n, "in batches of 1,000: every row sent more than an hour ago")
	require.Equal(t, map[string]int{"sent": 500}, states(t, db))
}
