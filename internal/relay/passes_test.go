package relay_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/outbox"
	"github.com/idemhq/idem/pkg/partition"
)

// keysOfLane returns n distinct keys whose lane is lane.
func keysOfLane(lane, n int) []string {
	var out []string
	for i := 0; len(out) < n; i++ {
		k := fmt.Sprintf("k%d", i)
		if partition.Of(k, relay.Lanes) == lane {
			out = append(out, k)
		}
	}
	return out
}

// newSlowAPI is a receiver that answers 200 after latency.
func newSlowAPI(t *testing.T, latency time.Duration) (*receiver, string) {
	return newReceiver(t, func(string, int) int {
		time.Sleep(latency)
		return http.StatusOK
	})
}

// TestAnAPIAnsweringWithinThePublishTimeoutIsSentEachRowOnce: an API that
// answers every request in 1.75 s, within the PublishTimeout of 2 s, and
// rows in lanes all over the relay's round. Every pass has its whole
// PublishTimeout for its requests: none is cut off mid-flight (which the
// API may have acted on) and sent again. (A relay that ran its passes
// side by side and made one wait for the other's publishing did.)
func TestAnAPIAnsweringWithinThePublishTimeoutIsSentEachRowOnce(t *testing.T) {
	db, _ := testenv.Schema(t)
	api, u := newSlowAPI(t, 1750*time.Millisecond)
	g := newGuard(t, db)
	n := 0
	for _, lane := range []int{0, 8, 16, 24} { // one lane in each group of 8
		for _, k := range keysOfLane(lane, 2) {
			id := fmt.Sprintf("e%02d", n)
			n++
			send(t, g, id, outbox.Message{EventID: id, To: "api", Key: k, Body: []byte(id)})
		}
	}
	run(t, relay.Config{DB: db, PublishTimeout: 2 * time.Second, Retention: time.Hour, MaxAttempts: 1000,
		Destinations: amqpDest(t, "api="+u)})
	require.Eventually(t, func() bool { return states(t, db)["sent"] == n }, 40*time.Second, 20*time.Millisecond)
	for k, c := range api.count() {
		require.Equal(t, 1, c, "%s: an answer within the PublishTimeout, requested %d times", k, c)
	}
}

// TestASlowHealthyAPIKeepsTheRelayReady: two keys with a backlog, in
// lanes 16 apart, to an API that answers each request in 300 ms. A pass
// sends its key's rows one after another while a request can still meet
// its own timeout within the pass's window (PublishTimeout + 1 s), then
// leaves the rest for the next: every request answered 200, no error. The
// relay is ready throughout.
func TestASlowHealthyAPIKeepsTheRelayReady(t *testing.T) {
	db, _ := testenv.Schema(t)
	_, u := newSlowAPI(t, 300*time.Millisecond)
	g := newGuard(t, db)
	for i, k := range []string{keysOfLane(0, 1)[0], keysOfLane(16, 1)[0]} {
		for j := range 40 {
			id := fmt.Sprintf("e%d-%02d", i, j)
			send(t, g, id, outbox.Message{EventID: id, To: "api", Key: k, Body: []byte(id)})
		}
	}
	r := run(t, relay.Config{DB: db, PublishTimeout: time.Second, Retention: time.Hour,
		Destinations: amqpDest(t, "api="+u)})
	require.Eventually(t, func() bool { return states(t, db)["sent"] > 0 }, 20*time.Second, 10*time.Millisecond)
	time.Sleep(100 * time.Millisecond) // the first pass's readiness is recorded
	var whys []string
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		if err := r.Ready(); err != nil && (len(whys) == 0 || whys[len(whys)-1] != err.Error()) {
			whys = append(whys, err.Error())
		}
	}
	require.Empty(t, whys, "every request was answered 200 within its timeout")
}

// brokerLink is a fault link in front of the test's RabbitMQ, and the
// AMQP URL that goes through it.
func brokerLink(t *testing.T) (*sandbox.Link, string) {
	t.Helper()
	f := sandbox.StartFaults()
	t.Cleanup(f.Close)
	link, u, err := f.LinkURL("broker", testenv.AMQPURL())
	require.NoError(t, err)
	return link, u
}

// TestConfirmsWithinThePublishTimeoutArePublishedOnce: a broker whose
// confirms come 1.2 s after each publish, within the PublishTimeout of
// 2 s, and rows in lanes all over the relay's round. Every pass has its
// whole PublishTimeout for its confirms: every row is published once, and
// the relay stays ready.
func TestConfirmsWithinThePublishTimeoutArePublishedOnce(t *testing.T) {
	db, _ := testenv.Schema(t)
	top := declare(t, testenv.Queue(t, testenv.AMQPURL()), 1)
	link, u := brokerLink(t)
	g := newGuard(t, db)
	r := run(t, relay.Config{DB: db, AMQPURLs: []string{u}, PublishTimeout: 2 * time.Second, Retention: time.Hour,
		Destinations: amqpDest(t, "q=queue:"+top.Queue)})
	// A first row dials the relay's connection; then the broker's frames
	// come 1.2 s late.
	send(t, g, "warm", outbox.Message{EventID: "warm", To: "q", Key: "warm", Body: []byte("warm")})
	require.Eventually(t, func() bool { return states(t, db)["sent"] == 1 }, 10*time.Second, 10*time.Millisecond)
	require.Len(t, take(t, 1, top.Queue), 1)
	require.NoError(t, link.LatencyOneWay(1200*time.Millisecond))
	var msgs []outbox.Message
	for _, lane := range []int{0, 8, 16, 24} {
		for _, k := range keysOfLane(lane, 5) {
			msgs = append(msgs, outbox.Message{EventID: "batch", Index: len(msgs), To: "q", Key: k, Body: []byte(k)})
		}
	}
	send(t, g, "batch", msgs...)
	n := len(msgs) + 1
	var mu sync.Mutex
	whys := map[string]bool{}
	stopWatch := make(chan struct{})
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		for {
			select {
			case <-stopWatch:
				return
			case <-time.After(10 * time.Millisecond):
			}
			if err := r.Ready(); err != nil && err.Error() != "not started" {
				mu.Lock()
				whys[err.Error()] = true
				mu.Unlock()
			}
		}
	}()
	require.Eventually(t, func() bool { return states(t, db)["sent"] == n }, 40*time.Second, 20*time.Millisecond)
	close(stopWatch)
	<-watched
	got := take(t, n-1, top.Queue)
	by := map[string]int{}
	for _, d := range got {
		by[d.MessageId]++
	}
	again := 0
	for _, c := range by {
		if c > 1 {
			again++
		}
	}
	assert.Zero(t, again, "of %d messages the broker confirmed within the PublishTimeout, %d were published again", n-1, again)
	for why := range whys {
		assert.NotContains(t, why, "refused", "a broker that answers every dial is reported as refusing it")
	}
	assert.Empty(t, whys, "the broker confirmed every publish within the PublishTimeout")
}

// TestSmallPoolsAndLaneSplitsKeepOrderAndFinish: pools of one to three
// connections (the listener holds one of them), and lane splits from one
// pass a round to 32, dividing the lanes or not: every row is published,
// each key's rows in order.
func TestSmallPoolsAndLaneSplitsKeepOrderAndFinish(t *testing.T) {
	for _, c := range []struct{ conns, lanes int }{{1, 8}, {2, 8}, {1, 1}, {2, 11}, {3, 16}, {3, 17}, {3, 32}} {
		t.Run(fmt.Sprintf("conns%d-lanes%d", c.conns, c.lanes), func(t *testing.T) {
			db, u := testenv.Schema(t)
			pool := tunedPool(t, u, func(pc *pgxpool.Config) { pc.MaxConns = int32(c.conns) })
			top := declare(t, testenv.Queue(t, testenv.AMQPURL()), 1)
			g := newGuard(t, db)
			const n = 200
			for i := range n / 10 {
				var msgs []outbox.Message
				id := fmt.Sprintf("e%03d", i)
				for j := range 10 {
					k := i*10 + j
					msgs = append(msgs, outbox.Message{EventID: id, Index: j, To: "q", Key: fmt.Sprintf("u%d", k%13), Body: []byte(fmt.Sprintf("%04d", k))})
				}
				send(t, g, id, msgs...)
			}
			run(t, relay.Config{DB: pool, AMQPURLs: []string{testenv.AMQPURL()}, BatchSize: 7, LanesPerPass: c.lanes,
				Destinations: amqpDest(t, "q=queue:"+top.Queue)})
			got := take(t, n, top.Queue)
			require.Len(t, got, n)
			last := map[int]int{}
			for _, d := range got {
				var k int
				_, err := fmt.Sscanf(string(d.Body), "%04d", &k)
				require.NoError(t, err)
				if p, ok := last[k%13]; ok {
					require.Less(t, p, k, "key u%d", k%13)
				}
				last[k%13] = k
			}
			require.Eventually(t, func() bool { return states(t, db)["pending"] == 0 }, 10*time.Second, 20*time.Millisecond)
		})
	}
}

// namedPool opens a pool on url whose sessions carry an application_name
// of the test's own, so that pg_stat_activity tells them apart from other
// tests'.
func namedPool(t *testing.T, url string) (*pgxpool.Pool, string) {
	t.Helper()
	name := testenv.Name(t)
	return tunedPool(t, url, func(pc *pgxpool.Config) { pc.ConnConfig.RuntimeParams["application_name"] = name }), name
}

// tunedPool opens a pool on url with tune's changes to its configuration,
// closed when the test ends.
func tunedPool(t *testing.T, url string, tune func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	pc, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	tune(pc)
	pool, err := pgxpool.NewWithConfig(context.Background(), pc)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// claimCounter counts the claims a pool runs (each begins with taking
// its lanes).
type claimCounter struct{ n atomic.Int64 }

func (c *claimCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.HasPrefix(d.SQL, "SELECT coalesce(array_agg(lane)") {
		c.n.Add(1)
	}
	return ctx
}

func (c *claimCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// notifications counts the idem_outbox notifications (every test's
// inserts notify) from now until the test ends: each may wake a relay.
func notifications(t *testing.T, u string) *atomic.Int64 {
	t.Helper()
	lc, err := pgx.Connect(context.Background(), u)
	require.NoError(t, err)
	_, err = lc.Exec(context.Background(), "LISTEN idem_outbox")
	require.NoError(t, err)
	var notes atomic.Int64
	lctx, stopListening := context.WithCancel(context.Background())
	listened := make(chan struct{})
	go func() {
		defer close(listened)
		for {
			if _, err := lc.WaitForNotification(lctx); err != nil {
				return
			}
			notes.Add(1)
		}
	}()
	t.Cleanup(func() { stopListening(); <-listened; _ = lc.Close(context.Background()) })
	return &notes
}

// TestAnIdleRelayClaimsEachLaneOncePerPoll: an idle relay looks at each
// lane once per PollInterval, or per notification (other tests' inserts
// notify too): Lanes/LanesPerPass claims a round.
func TestAnIdleRelayClaimsEachLaneOncePerPoll(t *testing.T) {
	_, u := testenv.Schema(t)
	var c claimCounter
	pool := tunedPool(t, u, func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = &c })
	notes := notifications(t, u) // each may start a round

	const poll, window = 250 * time.Millisecond, 2500 * time.Millisecond
	run(t, relay.Config{DB: pool, LanesPerPass: 1, PollInterval: poll, Destinations: amqpDest(t, "api=http://127.0.0.1:1")})
	time.Sleep(600 * time.Millisecond)
	claims0, notes0 := c.n.Load(), notes.Load()
	time.Sleep(window)
	claims, rounds := c.n.Load()-claims0, int64(window/poll)+notes.Load()-notes0
	t.Logf("%d claims in %s, %d polls and notifications", claims, window, rounds)
	require.GreaterOrEqual(t, claims, int64(window/poll/2)*relay.Lanes, "an idle relay polls")
	require.LessOrEqual(t, float64(claims), 1.25*float64(rounds*relay.Lanes), "one round of the lanes per poll or notification")
}

// TestAnIdleRoundCoversEveryLane: 5 lanes a pass do not divide the 32
// lanes. With a round of ⌊32/5⌋ = 6 empty passes, an idle relay woken by a
// row's notification left the two lanes before the round's first unread
// until the next poll: of rows sent one at a time, one a lane, the one on
// lane 1 already fell in that gap and waited out the poll. With ⌈32/5⌉ =
// 7, each is sent on its wake. (The default, 8 a pass, divides 32.)
func TestAnIdleRoundCoversEveryLane(t *testing.T) {
	db, _ := testenv.Schema(t)
	rcv, url := newReceiver(t, func(string, int) int { return http.StatusOK })
	g := newGuard(t, db)
	run(t, relay.Config{DB: db, LanesPerPass: 5, PollInterval: time.Minute, Retention: time.Hour, Destinations: amqpDest(t, "api="+url)})
	for lane := range relay.Lanes {
		id := fmt.Sprintf("e%02d", lane)
		send(t, g, id, outbox.Message{EventID: id, To: "api", Key: keysOfLane(lane, 1)[0], Body: []byte(id)})
		require.Eventually(t, func() bool { return rcv.count()[outbox.ID("pay", id, 0)] == 1 }, 10*time.Second, 10*time.Millisecond,
			"the row on lane %d waits for the next poll", lane)
	}
}

// TestARowCommittedWhileTheListenerReconnectsIsNotLeftForThePoll: the
// relay's LISTEN session ends (a restarted pooler, a terminated backend); a
// row committed before the listener is back notifies nobody. The listener
// wakes the relay once it listens again, and that round finds the row;
// before, it waited for the poll (here a minute).
func TestARowCommittedWhileTheListenerReconnectsIsNotLeftForThePoll(t *testing.T) {
	db, u := testenv.Schema(t)
	pool, app := namedPool(t, u)
	rcv, url := newReceiver(t, func(string, int) int { return http.StatusOK })
	g := newGuard(t, db)
	run(t, relay.Config{DB: pool, PollInterval: time.Minute, Retention: time.Hour, Destinations: amqpDest(t, "api="+url)})
	listener := func() (pid int) {
		_ = db.QueryRow(context.Background(), `SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND query = 'LISTEN idem_outbox'`, app).Scan(&pid)
		return pid
	}
	for i := range 3 {
		var pid int
		require.Eventually(t, func() bool { pid = listener(); return pid != 0 }, 10*time.Second, 5*time.Millisecond, "the relay listens")
		_, err := db.Exec(context.Background(), `SELECT pg_terminate_backend($1)`, pid)
		require.NoError(t, err)
		require.Eventually(t, func() bool { return listener() != pid }, 10*time.Second, time.Millisecond)
		id := fmt.Sprintf("e%d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "api", Key: id, Body: []byte(id)}) // the listener backs off 100 ms first
		require.Eventually(t, func() bool { return rcv.count()[outbox.ID("pay", id, 0)] == 1 }, 10*time.Second, 10*time.Millisecond,
			"%s, committed while the listener was away, waits for the poll", id)
	}
}

// TestASilentBrokerHoldsAPassOnlyItsBound: a broker that stops answering
// once the relay's connection is up (its frames come a minute late). A
// pass waits PublishTimeout for the confirms; the publisher that missed
// them is closed aside, since a silent broker holds a close for up to
// broker.CloseTimeout: no pass's transaction outlasts TxBound.
func TestASilentBrokerHoldsAPassOnlyItsBound(t *testing.T) {
	db, u := testenv.Schema(t)
	pool, app := namedPool(t, u)
	top := declare(t, testenv.Queue(t, testenv.AMQPURL()), 1)
	link, au := brokerLink(t)
	g := newGuard(t, db)
	cfg := relay.Config{DB: pool, AMQPURLs: []string{au}, PublishTimeout: time.Second, Retention: time.Hour,
		MaxAttempts: 1000, Destinations: amqpDest(t, "q=queue:"+top.Queue)}
	runBounded(t, cfg)
	// A first row dials the connection; then the broker is silent.
	send(t, g, "warm", outbox.Message{EventID: "warm", To: "q", Key: "warm", Body: []byte("warm")})
	require.Eventually(t, func() bool { return states(t, db)["sent"] == 1 }, 10*time.Second, 10*time.Millisecond)
	require.NoError(t, link.LatencyOneWay(time.Minute))
	for i := range 8 {
		id := fmt.Sprintf("e%d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "q", Key: id, Body: []byte(id)})
	}
	// The passes' transactions, running a statement or waiting between
	// them. Not the listener's session, idle between notifications: the
	// server delivers one in a short transaction of its own, which lasts
	// as long as a busy relay takes to read it.
	var longest time.Duration
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		var us int64
		require.NoError(t, db.QueryRow(context.Background(), `SELECT coalesce(max((extract(epoch FROM clock_timestamp() - xact_start) * 1e6)::bigint), 0)
FROM pg_stat_activity WHERE application_name = $1 AND xact_start IS NOT NULL AND state <> 'idle'`, app).Scan(&us))
		longest = max(longest, time.Duration(us)*time.Microsecond)
	}
	t.Logf("longest transaction %s, TxBound %s; states %v", longest, cfg.TxBound(), states(t, db))
	require.Less(t, longest, cfg.TxBound()+500*time.Millisecond, "no pass's transaction outlasts TxBound, whatever the broker does")
}

// TestAKeysLaterRequestIsNotStartedTooLateToBeAnswered: one key's three
// rows to an API that answers every request in 1.4 s, within the
// PublishTimeout of 2 s. A pass sends them one after another until its
// deadline (claim + PublishTimeout + 1 s); a request that could not meet
// its own timeout before it is not started (it would be cut off while the
// API works on it, and sent again), but left to the next pass: each row is
// requested once.
func TestAKeysLaterRequestIsNotStartedTooLateToBeAnswered(t *testing.T) {
	db, _ := testenv.Schema(t)
	api, u := newSlowAPI(t, 1400*time.Millisecond)
	g := newGuard(t, db)
	for i := range 3 {
		id := fmt.Sprintf("e%d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "api", Key: "one", Body: []byte(id)})
	}
	run(t, relay.Config{DB: db, PublishTimeout: 2 * time.Second, Retention: time.Hour, MaxAttempts: 1000,
		Destinations: amqpDest(t, "api="+u)})
	require.Eventually(t, func() bool { return states(t, db)["sent"] == 3 }, 30*time.Second, 20*time.Millisecond)
	for k, n := range api.count() {
		require.Equal(t, 1, n, "%s: answered within the PublishTimeout, requested %d times", k, n)
	}
}
