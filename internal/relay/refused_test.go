package relay_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/outbox"
)

// TestADroppedHandshakeLeavesTheRelayNotReadyAndRetrying: every relay
// connection is dropped right after the client's start-ok, which amqp091
// reports as bad credentials. The relay keeps its rows (no attempt spent),
// is not ready saying what the refusal may be, counts each in
// idem_outbox_broker_refusals_total, and publishes every row once the link
// heals.
func TestADroppedHandshakeLeavesTheRelayNotReadyAndRetrying(t *testing.T) {
	db, _ := testenv.Schema(t)
	top := declare(t, testenv.Queue(t, testenv.AMQPURL()), 1)
	g := newGuard(t, db)
	for i := range 5 {
		id := fmt.Sprintf("e%d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "q", Key: "k", Body: []byte(id)})
	}
	proxy, url := testenv.AMQPCut(t)
	cuts := make([]sandbox.Cut, 10000)
	for i := range cuts {
		cuts[i] = sandbox.Cut{Dir: sandbox.ToServer, Method: sandbox.ConnectionStartOk}
	}
	proxy.Arm(cuts...)
	reg := prometheus.NewRegistry()
	m, err := relay.NewMetrics(reg, []string{"q"})
	require.NoError(t, err)
	r := runBounded(t, relay.Config{DB: db, AMQPURLs: []string{url}, MaxAttempts: 2, Retention: time.Hour, Metrics: m,
		Destinations: amqpDest(t, "q=queue:"+top.Queue)})
	require.Eventually(t, func() bool { return proxy.Fired() >= 5 }, 30*time.Second, 20*time.Millisecond)
	err = r.Ready()
	require.ErrorContains(t, err, "RabbitMQ refused the connection or dropped it during the handshake")
	require.ErrorContains(t, err, "username or password not allowed")
	require.GreaterOrEqual(t, counter(t, reg, "idem_outbox_broker_refusals_total"), 4.0)
	require.Equal(t, map[string]int{"pending": 5}, states(t, db))

	proxy.Disarm()
	require.Eventually(t, func() bool { return states(t, db)["sent"] == 5 && r.Ready() == nil }, 30*time.Second, 20*time.Millisecond,
		"states: %v", states(t, db))
	for id, it := range rowsByEvent(t, db) {
		require.Equal(t, 1, it.Attempts, "%s: a dropped handshake spent an attempt", id)
	}
}

// counter reads the counter name from reg.
func counter(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() == name {
			return f.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("no %s", name)
	return 0
}
