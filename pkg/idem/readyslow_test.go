package idem_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/idem"
)

// TestReadyzSaysSlowWhileWorkGoesOn: Postgres gets far away, its round trip
// longer than /readyz's one-second ping, while events keep coming. The
// consumer still applies them, more slowly: /readyz answers 200 and says
// the database is slow. Once the link goes silent and nothing settles for
// a handler timeout, it answers 503. Before, it was 503 for as long as the
// latency lasted, the work going on.
func TestReadyzSaysSlowWhileWorkGoesOn(t *testing.T) {
	t.Parallel()
	db, dbURL, link := linkedSchema(t)
	amqpURL := testenv.AMQPURL()
	queue := testenv.Queue(t, amqpURL)
	cons := consumer.Config{URL: amqpURL, Queue: queue, HandlerTimeout: 15 * time.Second, StoreHold: time.Minute, BatchSize: 1}
	svc, _ := runService(t, idem.Config{Scope: "pay", DatabaseURL: viaLink(t, dbURL, link), Consumer: cons}, ledgerHandler{})
	health := httptest.NewServer(svc.Health())
	t.Cleanup(health.Close)
	readyz := func() (int, string) {
		res, err := http.Get(health.URL + "/readyz")
		require.NoError(t, err)
		defer res.Body.Close()
		body, err := io.ReadAll(res.Body)
		require.NoError(t, err)
		return res.StatusCode, string(body)
	}
	require.Eventually(t, func() bool { return testenv.QueueDepth(t, amqpURL, queue) >= 0 }, 20*time.Second, 50*time.Millisecond,
		"the consumer declared its queue")
	publish := publisher(t, amqpURL, queue)
	publish("e0")
	require.Eventually(t, func() bool { rows, _ := ledgerRows(t, db); return rows == 1 }, 30*time.Second, 20*time.Millisecond)
	require.Eventually(t, func() bool { code, _ := readyz(); return code == http.StatusOK }, 30*time.Second, 100*time.Millisecond)

	// Each round trip to Postgres now takes 1.2 s: more than the ping's
	// second, well within the handler timeout.
	require.NoError(t, link.LatencyOneWay(1200*time.Millisecond))
	t.Cleanup(func() { _ = link.Heal() })
	conn, err := amqp.Dial(amqpURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	ctx, stopPublishing := context.WithCancel(context.Background())
	published := make(chan struct{})
	go func() {
		defer close(published)
		for i := 1; ctx.Err() == nil; i++ {
			if err := publishID(ch, queue, fmt.Sprintf("e%d", i)); err != nil {
				t.Errorf("publish: %v", err)
				return
			}
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	t.Cleanup(func() { stopPublishing(); <-published })

	// Once events were applied over the slow link, /readyz says slow, and
	// ready.
	var body string
	require.Eventually(t, func() bool {
		rows, _ := ledgerRows(t, db)
		if rows < 3 {
			return false
		}
		var code int
		code, body = readyz()
		return code == http.StatusOK && containsLine(body, "postgres: slow: ")
	}, 60*time.Second, 200*time.Millisecond, "/readyz: the database is slow, the work goes on")
	t.Logf("slow: %s", body)

	// The link goes silent: nothing settles any more, and the consumer is
	// not ready within a handler timeout and a margin.
	stopPublishing()
	<-published
	require.NoError(t, link.Blackhole())
	publish("e_last")
	require.Eventually(t, func() bool {
		var code int
		code, body = readyz()
		return code == http.StatusServiceUnavailable && containsLine(body, "postgres: failing: ")
	}, cons.HandlerTimeout+30*time.Second, 200*time.Millisecond, "/readyz: work stopped")
	t.Logf("stopped: %s", body)
}

// containsLine reports whether a line of body starts with prefix.
func containsLine(body, prefix string) bool {
	for line := range strings.Lines(body) {
		if strings.HasPrefix(line, prefix) {
			return true
		}
	}
	return false
}
