package relay_test

import (
	"context"
	"fmt"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/outbox"
)

// gauge reads the gauge name{destination} from reg.
func gauge(t *testing.T, reg *prometheus.Registry, name, destination string) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "destination" && l.GetValue() == destination {
					return m.GetGauge().GetValue()
				}
			}
		}
	}
	t.Fatalf("no %s{destination=%q}", name, destination)
	return 0
}

// TestAWrongSecretPausesTheDestinationInsteadOfKillingItsRows: a webhook
// answers 401 to every request (a wrong signing secret), 50 rows of
// distinct keys, MaxAttempts 3. Before the pause, every row went dead at its
// first attempt. Now the destination pauses: no row is dead, none spends
// more than one attempt, the relay is not ready and says why, the gauge and
// idem_outbox_pause say so, the paused relay sends one probe at a time,
// and once the secret is fixed it resumes by itself and sends every row.
func TestAWrongSecretPausesTheDestinationInsteadOfKillingItsRows(t *testing.T) {
	db, _ := testenv.Schema(t)
	var fixed atomic.Bool
	rcv, url := newReceiver(t, func(string, int) int {
		if fixed.Load() {
			return http.StatusOK
		}
		return http.StatusUnauthorized
	})
	rcv.body = func(string) string { return "bad signature" }
	g := newGuard(t, db)
	for i := range 50 {
		id := fmt.Sprintf("e%02d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "webhook", Key: id, Body: []byte(id)})
	}
	reg := prometheus.NewRegistry()
	m, err := relay.NewMetrics(reg, []string{"webhook"})
	require.NoError(t, err)
	r := runBounded(t, relay.Config{DB: db, MaxAttempts: 3, Retention: time.Hour, Metrics: m, Name: "relay-a",
		BackoffMin: 50 * time.Millisecond, BackoffMax: 200 * time.Millisecond, Destinations: amqpDest(t, "webhook="+url)})

	require.Eventually(t, func() bool { return len(r.Paused()) == 1 }, 20*time.Second, 10*time.Millisecond)
	p := r.Paused()[0]
	require.Equal(t, "webhook", p.Destination)
	require.Equal(t, "http 401", p.Class)
	require.Contains(t, p.LastError, "bad signature")
	require.ErrorContains(t, r.Ready(), "destination webhook paused")
	require.Equal(t, 1.0, gauge(t, reg, "idem_outbox_destination_paused", "webhook"))
	require.Eventually(t, func() bool {
		ps, _, err := relay.ReadPauses(context.Background(), db)
		return err == nil && len(ps) == 1 && ps[0].Relay == "relay-a" && ps[0].Class == "http 401"
	}, 5*time.Second, 10*time.Millisecond)

	// Paused a while: probes go one at a time, and no row dies.
	before := total(rcv.count())
	time.Sleep(1500 * time.Millisecond)
	probes := r.Paused()[0].Probes
	require.GreaterOrEqual(t, probes, 2, "the relay probes on a backoff")
	require.LessOrEqual(t, total(rcv.count())-before, probes+1, "one request per probe")
	require.Zero(t, states(t, db)["dead"], "no row is dead for its destination's fault")
	for id, it := range rowsByEvent(t, db) {
		require.LessOrEqual(t, it.Attempts, 1, "%s spent more than the attempt that found the failure", id)
	}

	fixed.Store(true)
	require.Eventually(t, func() bool { return states(t, db)["sent"] == 50 && r.Ready() == nil }, 20*time.Second, 20*time.Millisecond,
		"states: %v, ready: %v", states(t, db), r.Ready())
	require.Empty(t, r.Paused())
	require.Equal(t, 0.0, gauge(t, reg, "idem_outbox_destination_paused", "webhook"))
	require.Eventually(t, func() bool {
		ps, _, err := relay.ReadPauses(context.Background(), db)
		return err == nil && len(ps) == 0
	}, 5*time.Second, 10*time.Millisecond, "the resumed destination's pause is deleted")
}

func total(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// TestAQueueDestinationWithoutItsQueuePausesUntilDeclared: the relay's
// queue destination names a queue nobody declared yet, so the broker
// returns every message unroutable. Before the pause, each return spent an
// attempt until the row was dead. Now the destination pauses, no row is
// dead, and once the queue is declared every row arrives. Then the queue is
// deleted and more rows come: the destination pauses again, and they arrive
// once it is declared again.
func TestAQueueDestinationWithoutItsQueuePausesUntilDeclared(t *testing.T) {
	db, _ := testenv.Schema(t)
	queue := testenv.Queue(t, testenv.AMQPURL())
	g := newGuard(t, db)
	enqueue := func(from, to int) {
		for i := from; i < to; i++ {
			id := fmt.Sprintf("e%02d", i)
			send(t, g, id, outbox.Message{EventID: id, To: "audit", Key: id, Body: []byte(id)})
		}
	}
	enqueue(0, 20)
	r := runBounded(t, relay.Config{DB: db, AMQPURLs: []string{testenv.AMQPURL()}, MaxAttempts: 2, Retention: time.Hour,
		BackoffMin: 50 * time.Millisecond, BackoffMax: 200 * time.Millisecond, Destinations: amqpDest(t, "audit=queue:"+queue)})
	require.Eventually(t, func() bool { return len(r.Paused()) == 1 }, 20*time.Second, 10*time.Millisecond)
	require.Equal(t, "amqp: returned unroutable", r.Paused()[0].Class)
	time.Sleep(time.Second)
	require.Zero(t, states(t, db)["dead"], "no row is dead for a queue not declared yet")

	top := declare(t, queue, 1)
	require.Len(t, take(t, 20, top.Queues()...), 20)
	require.Eventually(t, func() bool { return states(t, db)["sent"] == 20 && r.Ready() == nil }, 20*time.Second, 20*time.Millisecond)

	require.NoError(t, sandbox.DeleteQueue(testenv.AMQPURL(), queue))
	enqueue(20, 40)
	require.Eventually(t, func() bool { return len(r.Paused()) == 1 }, 20*time.Second, 10*time.Millisecond, "states: %v", states(t, db))
	time.Sleep(time.Second)
	require.Zero(t, states(t, db)["dead"], "no row is dead for a queue deleted under the relay")
	declare(t, queue, 1)
	require.Len(t, take(t, 20, top.Queues()...), 20)
	require.Eventually(t, func() bool { return states(t, db)["sent"] == 40 && r.Ready() == nil }, 20*time.Second, 20*time.Millisecond)
}

// TestWhichAnswersAreFinalIsPerDestination: by default a 422 is final and a
// 401 is not; a destination whose Final lists 401 and not 422 has it the
// other way round. One row each, so nothing pauses.
func TestWhichAnswersAreFinalIsPerDestination(t *testing.T) {
	db, _ := testenv.Schema(t)
	status := map[string]int{}
	for _, d := range []string{"dflt", "own"} {
		status[outbox.ID("pay", d+"-401", 0)] = http.StatusUnauthorized
		status[outbox.ID("pay", d+"-422", 0)] = http.StatusUnprocessableEntity
	}
	rcv, url := newReceiver(t, func(key string, _ int) int { return status[key] })
	g := newGuard(t, db)
	for _, d := range []string{"dflt", "own"} {
		for _, c := range []string{"401", "422"} {
			id := d + "-" + c
			send(t, g, id, outbox.Message{EventID: id, To: d, Key: id, Body: []byte(id)})
		}
	}
	dests := amqpDest(t, "dflt="+url+" own="+url)
	own := dests["own"]
	own.Final = []int{401}
	dests["own"] = own
	runBounded(t, relay.Config{DB: db, MaxAttempts: 3, Retention: time.Hour, Destinations: dests})
	require.Eventually(t, func() bool { return states(t, db)["dead"] == 4 }, 20*time.Second, 20*time.Millisecond, "states: %v", states(t, db))
	seen := rcv.count()
	require.Equal(t, 3, seen[outbox.ID("pay", "dflt-401", 0)], "a 401 is tried again by default")
	require.Equal(t, 1, seen[outbox.ID("pay", "dflt-422", 0)], "a 422 is final by default")
	require.Equal(t, 1, seen[outbox.ID("pay", "own-401", 0)], "Final lists 401")
	require.Equal(t, 3, seen[outbox.ID("pay", "own-422", 0)], "Final leaves 422 out")
}

func TestParseStatuses(t *testing.T) {
	got, err := relay.ParseStatuses("400-404, 422,409,403")
	require.NoError(t, err)
	require.Equal(t, []int{400, 401, 402, 403, 404, 409, 422}, got)
	got, err = relay.ParseStatuses("")
	require.NoError(t, err)
	require.NotNil(t, got, "an empty list: nothing is final")
	require.Empty(t, got)
	for _, bad := range []string{"200", "404-400", "4xx", "600"} {
		_, err := relay.ParseStatuses(bad)
		require.Error(t, err, bad)
	}
}
