package relay_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/outbox"
)

// runBounded runs a relay like run, but fails the test (instead of hanging
// it) if the relay does not return within 5s of its context's end: a relay
// that ignores SIGTERM is the defect some of these tests look for.
func runBounded(t *testing.T, cfg relay.Config) *relay.Relay {
	t.Helper()
	if cfg.PollInterval == 0 {
		cfg.PollInterval = 50 * time.Millisecond
	}
	if cfg.BackoffMin == 0 {
		cfg.BackoffMin, cfg.BackoffMax = 10*time.Millisecond, 50*time.Millisecond
	}
	if cfg.PublishTimeout == 0 {
		cfg.PublishTimeout = 2 * time.Second
	}
	r, err := relay.New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Error("the relay did not stop within 5s of its context's end")
		}
	})
	return r
}

// rowsByEvent returns every outbox row by its event ID.
func rowsByEvent(t *testing.T, db *pgxpool.Pool) map[string]relay.Message {
	t.Helper()
	out := map[string]relay.Message{}
	for _, st := range []string{"pending", "sent", "dead"} {
		items, err := relay.List(context.Background(), db, relay.Filter{State: st, Limit: 10000})
		require.NoError(t, err)
		for _, it := range items {
			out[it.EventID] = it
		}
	}
	return out
}

// TestALostBrokerConnectionNeverWedgesTheRelay: 300 rows of one key, the
// connection cut at the first basic.publish, then at a confirm. The relay
// reconnects and publishes every row; the cuts spend no attempt (every row
// is sent on its first counted attempt); and the relay stops when told.
func TestALostBrokerConnectionNeverWedgesTheRelay(t *testing.T) {
	db, _ := testenv.Schema(t)
	top := declare(t, testenv.Queue(t, testenv.AMQPURL()), 1)
	g := newGuard(t, db)
	for i := range 300 {
		id := fmt.Sprintf("e%03d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "q", Key: "one-key", Body: []byte(id)})
	}
	proxy, url := testenv.AMQPCut(t)
	proxy.Arm(sandbox.Cut{Dir: sandbox.ToServer, Method: sandbox.BasicPublish},
		sandbox.Cut{Dir: sandbox.ToClient, Method: sandbox.BasicAck})
	runBounded(t, relay.Config{DB: db, AMQPURLs: []string{url}, MaxAttempts: 1, Retention: time.Hour,
		Destinations: amqpDest(t, "q=queue:"+top.Queue)})
	require.Eventually(t, func() bool { return states(t, db)["sent"] == 300 }, 30*time.Second, 50*time.Millisecond,
		"states: %v", states(t, db))
	require.Equal(t, 2, proxy.Fired())
	for id, it := range rowsByEvent(t, db) {
		require.Equal(t, 1, it.Attempts, "%s: a lost connection spent an attempt", id)
	}
	require.GreaterOrEqual(t, testenv.QueueDepth(t, testenv.AMQPURL(), top.Queue), 300)
}

// TestABrokerOutageNeverMakesARowDead: every connection of the relay is cut
// before its first confirm reaches it (amqp091 then resolves the pending
// confirms as nacks), three times over, with MaxAttempts 2. No row goes
// dead; all are sent once the broker answers.
func TestABrokerOutageNeverMakesARowDead(t *testing.T) {
	db, _ := testenv.Schema(t)
	top := declare(t, testenv.Queue(t, testenv.AMQPURL()), 1)
	g := newGuard(t, db)
	for i := range 5 {
		id := fmt.Sprintf("e%d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "q", Key: "k", Body: []byte(id)})
	}
	proxy, url := testenv.AMQPCut(t)
	for range 3 {
		proxy.Arm(sandbox.Cut{Dir: sandbox.ToClient, Method: sandbox.BasicAck})
	}
	runBounded(t, relay.Config{DB: db, AMQPURLs: []string{url}, MaxAttempts: 2, Retention: time.Hour,
		Destinations: amqpDest(t, "q=queue:"+top.Queue)})
	require.Eventually(t, func() bool { return states(t, db)["sent"] == 5 }, 30*time.Second, 50*time.Millisecond,
		"states: %v", states(t, db))
	require.Equal(t, 3, proxy.Fired())
	require.Zero(t, states(t, db)["dead"])
}

// TestAReturnedMessageWhoseConnectionDropsDoesNotWedge: the broker returns
// an unroutable message, and the connection drops before the confirm that
// follows the return. The relay neither spins nor counts the cut; the
// next connection's return spends the attempts, and the row goes dead with
// the return as its reason.
func TestAReturnedMessageWhoseConnectionDropsDoesNotWedge(t *testing.T) {
	db, _ := testenv.Schema(t)
	g := newGuard(t, db)
	send(t, g, "e1", outbox.Message{EventID: "e1", To: "q", Body: []byte("x")})
	proxy, url := testenv.AMQPCut(t)
	proxy.Arm(sandbox.Cut{Dir: sandbox.ToClient, Method: sandbox.BasicAck})
	runBounded(t, relay.Config{DB: db, AMQPURLs: []string{url}, MaxAttempts: 2,
		Destinations: amqpDest(t, "q=queue:idem.test.no-such-queue-"+testenv.Name(t))})
	require.Eventually(t, func() bool { return states(t, db)["dead"] == 1 }, 30*time.Second, 50*time.Millisecond)
	require.Equal(t, 1, proxy.Fired())
	it := rowsByEvent(t, db)["e1"]
	require.Equal(t, 2, it.Attempts)
	require.Contains(t, it.LastError, "NO_ROUTE")
}

// TestAPoisonRowGoesDeadWithoutBlockingItsLane: a row that can never be
// published (a type over AMQP's 255 bytes, written before Enqueue checked
// it; a message to an exchange that does not exist) spends its attempts
// and goes dead with its reason; the rows of its lane and key are sent.
func TestAPoisonRowGoesDeadWithoutBlockingItsLane(t *testing.T) {
	db, _ := testenv.Schema(t)
	top := declare(t, testenv.Queue(t, testenv.AMQPURL()), 1)
	g := newGuard(t, db)
	for i := range 20 {
		id := fmt.Sprintf("e%02d", i)
		to := "q"
		if i == 12 {
			to = "nowhere"
		}
		send(t, g, id, outbox.Message{EventID: id, To: to, Key: "one-key", Body: []byte(id)})
	}
	_, err := db.Exec(context.Background(), `UPDATE idem_outbox SET type = repeat('t', 300) WHERE event_id = 'e05'`)
	require.NoError(t, err)
	runBounded(t, relay.Config{DB: db, AMQPURLs: []string{testenv.AMQPURL()}, MaxAttempts: 3, Retention: time.Hour,
		Destinations: amqpDest(t, "q=queue:"+top.Queue+" nowhere=exchange:idem.test.no-such-exchange-"+testenv.Name(t))})
	require.Eventually(t, func() bool { s := states(t, db); return s["sent"] == 18 && s["dead"] == 2 }, 30*time.Second, 50*time.Millisecond,
		"states: %v", states(t, db))
	rows := rowsByEvent(t, db)
	require.Contains(t, rows["e05"].LastError, "AMQP allows 255")
	require.Equal(t, 3, rows["e05"].Attempts)
	require.Contains(t, rows["e12"].LastError, "404")
	require.Equal(t, 3, rows["e12"].Attempts)
}

// TestOneRowsBadMarkNeverRollsBackItsNeighbours: an API answers 500 with a
// body whose 200-byte cut falls inside a multi-byte character. The error
// is stored as valid UTF-8, the row retries and goes dead, and the row
// beside it in the same pass is sent once, not again with every pass.
func TestOneRowsBadMarkNeverRollsBackItsNeighbours(t *testing.T) {
	db, _ := testenv.Schema(t)
	bad := outbox.ID("pay", "bad", 0)
	body := strings.Repeat("a", 199) + "é and more"
	rcv, url := newReceiver(t, nil)
	rcv.answer = func(key string, _ int) int {
		if key == bad {
			return http.StatusInternalServerError
		}
		return http.StatusOK
	}
	rcv.body = func(key string) string {
		if key == bad {
			return body
		}
		return ""
	}
	g := newGuard(t, db)
	send(t, g, "bad", outbox.Message{EventID: "bad", To: "api", Key: "a", Body: []byte("bad")})
	send(t, g, "good", outbox.Message{EventID: "good", To: "api", Key: "b", Body: []byte("good")})
	runBounded(t, relay.Config{DB: db, MaxAttempts: 3, Retention: time.Hour, Destinations: amqpDest(t, "api="+url)})
	require.Eventually(t, func() bool { return states(t, db)["dead"] == 1 }, 20*time.Second, 20*time.Millisecond,
		"states: %v", states(t, db))
	require.Equal(t, 1, rcv.count()[outbox.ID("pay", "good", 0)], "the neighbour is sent once")
	require.Equal(t, 3, rcv.count()[bad])
	it := rowsByEvent(t, db)["bad"]
	require.True(t, utf8.ValidString(it.LastError))
	require.Contains(t, it.LastError, "http 500")
}

// TestARelayWhoseEveryPublishFailsIsNotReady: a destination that answers
// 503 to everything; after a few passes /readyz says the relay sends
// nothing, and it is ready again once the destination recovers.
func TestARelayWhoseEveryPublishFailsIsNotReady(t *testing.T) {
	db, _ := testenv.Schema(t)
	down := true
	rcv, url := newReceiver(t, nil)
	rcv.answer = func(string, int) int {
		rcv.mu.Lock()
		defer rcv.mu.Unlock()
		if down {
			return http.StatusServiceUnavailable
		}
		return http.StatusOK
	}
	g := newGuard(t, db)
	for i := range 3 {
		id := fmt.Sprintf("e%d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "api", Body: []byte(id)})
	}
	r := runBounded(t, relay.Config{DB: db, MaxAttempts: 1000, Retention: time.Hour, Destinations: amqpDest(t, "api="+url)})
	require.Eventually(t, func() bool { err := r.Ready(); return err != nil && strings.Contains(err.Error(), "sent nothing") },
		20*time.Second, 20*time.Millisecond)
	rcv.mu.Lock()
	down = false
	rcv.mu.Unlock()
	require.Eventually(t, func() bool { return states(t, db)["sent"] == 3 && r.Ready() == nil }, 20*time.Second, 20*time.Millisecond)
}

// TestAHangingDestinationHoldsAPassOnlyItsBound: an API that never answers,
// 400 keys. A pass holds its transaction and its rows' locks for at most
// PublishTimeout and a second, not one request timeout per 16 keys (7.5 s
// here): what it did not reach waits for the next pass, spending nothing.
// The requests that timed out are distinct rows failing alike: the
// destination pauses, and they spend nothing either.
func TestAHangingDestinationHoldsAPassOnlyItsBound(t *testing.T) {
	db, _ := testenv.Schema(t)
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(release) })
	g := newGuard(t, db)
	for i := range 400 {
		id := fmt.Sprintf("e%03d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "api", Key: id, Body: []byte(id)})
	}
	start := time.Now()
	r := runBounded(t, relay.Config{DB: db, MaxAttempts: 1000, PublishTimeout: 300 * time.Millisecond, Retention: time.Hour, LanesPerPass: relay.Lanes,
		Destinations: amqpDest(t, "api="+srv.URL)})
	require.Eventually(t, func() bool { return len(r.Paused()) > 0 }, 20*time.Second, 20*time.Millisecond)
	took := time.Since(start)
	require.Less(t, took, 4*time.Second, "the first pass held its rows %s", took)
	require.Contains(t, r.Paused()[0].Class, "no answer")
	var tried int
	require.NoError(t, db.QueryRow(context.Background(), `SELECT count(*) FROM idem_outbox WHERE attempts > 0`).Scan(&tried))
	require.Zero(t, tried, "no row spent an attempt on a destination that never answered")
}
