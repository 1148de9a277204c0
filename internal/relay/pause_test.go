package relay_test

import (
	"context"
	"fmt"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/jackc/pgx/v5/pgxpool"

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
// once it is declared again; the rows that failed within 10×BackoffMin of
// the last that passed spent a few attempts, no more.
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
	r := runBounded(t, relay.Config{DB: db, AMQPURLs: []string{testenv.AMQPURL()}, MaxAttempts: 20, Retention: time.Hour,
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
	for id, it := range rowsByEvent(t, db) {
		// Rows that fail within 10×BackoffMin of rows that passed spend
		// their attempts (they may fail on their own): a few, then the pause.
		require.LessOrEqual(t, it.Attempts, 6, "%s", id)
	}
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

// Found in review, and failing before its fix: a single poison row (500 on its own body) is the oldest row of a
// destination that paused for a real outage. Every probe picks it (lowest
// id, and a failed probe spends nothing, so it stays due and never dies):
// the destination, healthy again, never resumes.
func TestAPoisonRowNeverKeepsARecoveredDestinationPaused(t *testing.T) {
	db, _ := testenv.Schema(t)
	var fixed atomic.Bool
	poison := outbox.ID("pay", "e00", 0)
	_, url := newReceiver(t, func(key string, _ int) int {
		if key == poison || !fixed.Load() {
			return http.StatusInternalServerError
		}
		return http.StatusOK
	})
	g := newGuard(t, db)
	for i := range 20 {
		id := fmt.Sprintf("e%02d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "api", Key: "acct-1", Body: []byte(id)}) // one key: one lane
	}
	// One key: a pass tries its oldest due row and skips the rest, so the
	// five distinct failures that pause come one pass at a time while e00
	// retries on its backoff. MaxAttempts leaves e00 far from dead by then
	// (with 3, e00 and at times e01 were dead before the pause, and the
	// test neither tried what it says nor could see 19 rows sent).
	r := runBounded(t, relay.Config{DB: db, MaxAttempts: 20, Retention: time.Hour,
		BackoffMin: 50 * time.Millisecond, BackoffMax: 200 * time.Millisecond, Destinations: amqpDest(t, "api="+url)})
	require.Eventually(t, func() bool { return len(r.Paused()) == 1 }, 20*time.Second, 10*time.Millisecond)
	require.Equal(t, map[string]int{"pending": 20}, states(t, db), "every row pending as the destination pauses, e00 the oldest")
	fixed.Store(true) // the outage is over; only e00 still fails, on its own merits
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.Equal(c, 19, states(t, db)["sent"])
		assert.Empty(c, r.Paused())
	}, 10*time.Second, 50*time.Millisecond)
	require.NotEqual(t, "sent", rowsByEvent(t, db)["e00"].State)
}

// Found in review, and failing before its fix: five poison rows of distinct keys (each 500 on its own body) ahead of
// healthy rows pause a healthy destination, although the healthy rows were
// answered 2xx in the very same pass; every probe is a poison row, so it
// never resumes and the rows enqueued after are held without bound.
func TestPoisonRowsBesideRowsThatPassNeverPause(t *testing.T) {
	db, _ := testenv.Schema(t)
	bad := map[string]bool{}
	for i := range 5 {
		bad[outbox.ID("pay", fmt.Sprintf("p%d", i), 0)] = true
	}
	_, url := newReceiver(t, func(key string, _ int) int {
		if bad[key] {
			return http.StatusInternalServerError
		}
		return http.StatusOK
	})
	g := newGuard(t, db)
	for i := range 5 {
		id := fmt.Sprintf("p%d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "api", Key: id, Body: []byte(id)})
	}
	for i := range 10 {
		id := fmt.Sprintf("h%02d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "api", Key: id, Body: []byte(id)})
	}
	r := runBounded(t, relay.Config{DB: db, MaxAttempts: 3, Retention: time.Hour, LanesPerPass: relay.Lanes,
		BackoffMin: 50 * time.Millisecond, BackoffMax: 200 * time.Millisecond, Destinations: amqpDest(t, "api="+url)})
	require.Eventually(t, func() bool { return states(t, db)["sent"] == 10 }, 10*time.Second, 20*time.Millisecond)
	for i := range 10 {
		id := fmt.Sprintf("late%02d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "api", Key: id, Body: []byte(id)})
	}
	time.Sleep(3 * time.Second)
	require.Empty(t, r.Paused(), "a healthy destination (every other row answered 2xx) is paused by 5 poison rows")
	require.Equal(t, 20, states(t, db)["sent"], "states: %v", states(t, db))
	require.Equal(t, 5, states(t, db)["dead"], "poison rows never spend their attempts: states %v", states(t, db))
}

// Found in review, and failing before its fix: an overloaded API answers 503 and 429 alike (every row fails, the
// destination's fault), but the classes alternate, so the run of distinct
// rows restarts at each row and never reaches PauseRows: every row dies.
func TestAnOutageAnsweringMixedStatusesPauses(t *testing.T) {
	db, _ := testenv.Schema(t)
	odd := map[string]bool{}
	for i := 1; i < 20; i += 2 {
		odd[outbox.ID("pay", fmt.Sprintf("e%02d", i), 0)] = true
	}
	_, url := newReceiver(t, func(key string, _ int) int {
		if odd[key] { // the rate limiter refuses some, the overloaded backend the others
			return http.StatusTooManyRequests
		}
		return http.StatusServiceUnavailable
	})
	g := newGuard(t, db)
	for i := range 20 {
		id := fmt.Sprintf("e%02d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "api", Key: id, Body: []byte(id)})
	}
	r := runBounded(t, relay.Config{DB: db, MaxAttempts: 3, Retention: time.Hour, LanesPerPass: relay.Lanes,
		BackoffMin: 20 * time.Millisecond, BackoffMax: 50 * time.Millisecond, Destinations: amqpDest(t, "api="+url)})
	time.Sleep(3 * time.Second)
	require.Zero(t, states(t, db)["dead"], "rows dead for the destination's fault; paused: %v", r.Paused())
}

// Found in review, and failing before its fix: a relay that paused and was restarted (or died) leaves its
// idem_outbox_pause row behind for ever: the new process starts closed,
// never "resumes", so never deletes it, and `idem outbox list` marks the
// destination's rows "pending (paused)" though every row was sent.
func TestAPauseRowNeverOutlivesItsDestinationsRecovery(t *testing.T) {
	db, _ := testenv.Schema(t)
	var fixed atomic.Bool
	_, url := newReceiver(t, func(string, int) int {
		if fixed.Load() {
			return http.StatusOK
		}
		return http.StatusUnauthorized
	})
	g := newGuard(t, db)
	for i := range 10 {
		id := fmt.Sprintf("e%02d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "api", Key: id, Body: []byte(id)})
	}
	cfg := relay.Config{DB: db, MaxAttempts: 3, Retention: time.Hour, Name: "relay-a", PollInterval: 50 * time.Millisecond,
		BackoffMin: 50 * time.Millisecond, BackoffMax: 200 * time.Millisecond, Destinations: amqpDest(t, "api="+url)}
	r1, err := relay.New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = r1.Run(ctx) }()
	require.Eventually(t, func() bool {
		ps, _, err := relay.ReadPauses(context.Background(), db)
		return err == nil && len(ps) == 1
	}, 20*time.Second, 10*time.Millisecond)
	cancel()
	<-done

	fixed.Store(true)
	runBounded(t, cfg) // the same relay, restarted
	require.Eventually(t, func() bool { return states(t, db)["sent"] == 10 }, 10*time.Second, 20*time.Millisecond)
	time.Sleep(time.Second)
	ps, _, err := relay.ReadPauses(context.Background(), db)
	require.NoError(t, err)
	require.Empty(t, ps, "a stale pause row stays after its destination works again")
}

// Found in review, and failing before its fix: two shards' relays share the gauge. Shard 0 stays paused (its probe
// keeps failing) while shard 1 pauses then resumes: the gauge says 0.
func TestShardsCountTheirPausesInOneGauge(t *testing.T) {
	db0, _ := testenv.Schema(t)
	db1, _ := testenv.Schema(t)
	var fixed1 atomic.Bool
	shard1 := map[string]bool{}
	for i := range 10 {
		shard1[outbox.ID("pay", fmt.Sprintf("f%02d", i), 0)] = true
	}
	_, url := newReceiver(t, func(key string, _ int) int {
		if fixed1.Load() && shard1[key] { // shard 0's destination stays down (say, its probe is a poison row)
			return http.StatusOK
		}
		return http.StatusServiceUnavailable
	})
	reg := prometheus.NewRegistry()
	m, err := relay.NewMetrics(reg, []string{"api"})
	require.NoError(t, err)
	g0 := newGuard(t, db0)
	for i := range 10 {
		id := fmt.Sprintf("e%02d", i)
		send(t, g0, id, outbox.Message{EventID: id, To: "api", Key: id, Body: []byte(id)})
	}
	g1 := newGuard(t, db1)
	rs, err := relay.PerShard(relay.Config{MaxAttempts: 3, Retention: time.Hour, Metrics: m, PollInterval: 50 * time.Millisecond,
		BackoffMin: 50 * time.Millisecond, BackoffMax: 200 * time.Millisecond, Destinations: amqpDest(t, "api="+url)}, []*pgxpool.Pool{db0, db1})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); relay.RunAll(ctx, rs) }()
	t.Cleanup(func() { cancel(); <-done })
	require.Eventually(t, func() bool { return len(rs[0].Paused()) == 1 }, 20*time.Second, 10*time.Millisecond)
	for i := range 10 {
		id := fmt.Sprintf("f%02d", i)
		send(t, g1, id, outbox.Message{EventID: id, To: "api", Key: id, Body: []byte(id)})
	}
	require.Eventually(t, func() bool { return len(rs[1].Paused()) == 1 }, 20*time.Second, 10*time.Millisecond)
	fixed1.Store(true)
	require.Eventually(t, func() bool { return len(rs[1].Paused()) == 0 }, 20*time.Second, 10*time.Millisecond)
	require.Len(t, rs[0].Paused(), 1)
	require.Equal(t, 1.0, gauge(t, reg, "idem_outbox_destination_paused", "api"), "shard 0 is still paused")
}
