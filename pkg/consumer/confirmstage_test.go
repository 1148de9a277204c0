package consumer_test

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/fastkey"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/guard/redistier"
	"github.com/idemhq/idem/pkg/partition"
)

// startRigLockTimeout is startRigWith whose consumer's pool has a
// lock_timeout (as idem sets it from HandlerTimeout in production), so that
// a claim waiting on a row another session holds ends in LockNotAvailable
// and is held in place (I15). r.pool is a pool of the same schema without
// it, for the test's own sessions.
func startRigLockTimeout[T any](t *testing.T, h consumer.Handler[T], fast guard.FastPath, lockTimeout string, tune func(*consumer.Config)) *rig {
	t.Helper()
	r, _, _ := startRigPool(t, h, fast, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["lock_timeout"] = lockTimeout }, tune)
	return r
}

// startRigPool is startRigWith with a consumer's pool of the test's making
// (tunePool), which it returns, and a stop func that ends Run as SIGTERM
// does and returns how long Run took to return. r.pool is another pool of
// the same schema, for the test's own sessions.
func startRigPool[T any](t *testing.T, h consumer.Handler[T], fast guard.FastPath, tunePool func(*pgxpool.Config), tune func(*consumer.Config)) (*rig, *pgxpool.Pool, func() time.Duration) {
	t.Helper()
	admin, u := testenv.Schema(t, testenv.Effects)
	pcfg, err := pgxpool.ParseConfig(u)
	require.NoError(t, err)
	if tunePool != nil {
		tunePool(pcfg)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	url := testenv.AMQPURL()
	r := &rig{t: t, pool: admin, queue: testenv.Queue(t, url), stats: map[string]*atomic.Int64{}}
	for _, o := range guard.Outcomes() {
		r.stats[o.String()] = &atomic.Int64{}
	}
	for _, name := range wire.Counters() {
		r.stats[name] = &atomic.Int64{}
	}
	g, err := guard.New(guard.Config{Scope: "svc", Store: pgtier.New(pool), Fast: fast})
	require.NoError(t, err)
	cfg := consumer.Config{
		URL: url, Queue: r.queue, Workers: 2, Prefetch: 4, DeliveryLimit: 2,
		RetryBackoff: consumer.Backoff{Min: 10 * time.Millisecond, Max: 50 * time.Millisecond},
		Observer:     r,
		// A failing test shows what the consumer warned of (a trip, a
		// lost session), beside how Run ended if it ended early.
		Logger: testenv.LoggerAt(t, slog.LevelInfo),
	}
	if tune != nil {
		tune(&cfg)
	}
	c, err := consumer.New(cfg, g, h)
	require.NoError(t, err)
	r.consumerStats = c.Stats
	conn, err := amqp.Dial(url)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	r.ch, err = conn.Channel()
	require.NoError(t, err)
	topo := broker.TopologyFor(cfg.Queue, cfg.BrokerDeliveryLimit)
	topo.Partitions = cfg.Partitions
	require.NoError(t, topo.Declare(r.ch))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	ended := make(chan struct{})
	r.ended = ended
	go func() {
		err := c.Run(ctx)
		if ctx.Err() == nil {
			cfg.Logger.Error("Run returned before the test stopped it", "err", err)
		}
		done <- err
		close(ended)
	}()
	var took time.Duration
	var stopped atomic.Bool
	stop := func() time.Duration {
		if stopped.CompareAndSwap(false, true) {
			began := time.Now()
			cancel()
			require.NoError(t, <-done)
			took = time.Since(began)
		}
		return took
	}
	t.Cleanup(func() { stop() })
	return r, pool, stop
}

// marker returns the fast tier's value for id ("" if none).
func markerOf(t *testing.T, rdb *redis.Client, prefix, id string) string {
	t.Helper()
	v, err := rdb.Get(context.Background(), fastkey.Key(prefix, "svc", id)).Result()
	if err == redis.Nil {
		return ""
	}
	require.NoError(t, err)
	return v
}

// lastSettlement returns the last settlement of id with outcome o, if any.
func lastSettlement(r *rig, id string, o guard.Outcome) (settledAt, bool) {
	var out settledAt
	found := false
	for _, s := range r.settlements() {
		if s.EventID == id && s.Outcome == o {
			out, found = s, true
		}
	}
	return out, found
}

// restoredWithStaleMarkers processes ids once (done markers of the first
// history), then empties the dedup table as a restore does: every marker
// now names a history the store no longer has.
func restoredWithStaleMarkers(t *testing.T, r *rig, rdb *redis.Client, prefix string, ids ...string) {
	t.Helper()
	for _, id := range ids {
		r.publish(id, "body of "+id)
	}
	require.Eventually(t, func() bool { return r.stats[guard.OutcomeProcessed.String()].Load() == int64(len(ids)) },
		30*time.Second, 5*time.Millisecond)
	waitForMarkers(t, rdb, prefix, ids...)
	_, err := r.pool.Exec(context.Background(), `TRUNCATE idem_processed`)
	require.NoError(t, err)
}

// waitForMarkers waits until Redis holds a done marker for each of ids.
func waitForMarkers(t *testing.T, rdb *redis.Client, prefix string, ids ...string) {
	t.Helper()
	require.Eventually(t, func() bool {
		for _, id := range ids {
			if !strings.HasPrefix(markerOf(t, rdb, prefix, id), "done:") {
				return false
			}
		}
		return true
	}, 10*time.Second, 5*time.Millisecond, "the done markers were never written")
}

// blockedBy counts the sessions waiting on a lock the backend pid holds.
func blockedBy(t *testing.T, pool *pgxpool.Pool, pid int) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(),
		`SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))`, pid).Scan(&n))
	return n
}

// lockRows begins a transaction on r.pool that inserts the dedup rows of ids
// and holds them (another consumer's transaction in progress), until the
// returned func rolls it back. waiters counts the sessions waiting on it.
func lockRows(t *testing.T, r *rig, ids ...string) (release func(), waiters func() int) {
	t.Helper()
	ctx := context.Background()
	tx, err := r.pool.Begin(ctx)
	require.NoError(t, err)
	var pid int
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	waiters = func() int { return blockedBy(t, r.pool, pid) }
	for _, id := range ids {
		_, err := tx.Exec(ctx, `INSERT INTO idem_processed (scope, event_id, payload_hash) VALUES ('svc', $1, $2)`,
			id, guard.HashFields("body of "+id))
		require.NoError(t, err)
	}
	var once atomic.Bool
	release = func() {
		if once.CompareAndSwap(false, true) {
			_ = tx.Rollback(ctx)
		}
	}
	t.Cleanup(release)
	return release, waiters
}

// TestADuplicateRedisKnowsIsNotHeldBehindAnotherEventsLockWait: after a
// restore, event A's marker is stale, so A goes to the store, where its
// claim waits on a row another consumer's open transaction holds: A is held
// in place (I15), for up to StoreHold. Event C is a duplicate whose marker
// names the current history: its outcome is known after one shared history
// read, and it must be acked at once (I16: the fast path stays fast), not
// wait for A's hold. Per-event, as BatchSize 1 runs it.
func TestADuplicateRedisKnowsIsNotHeldBehindAnotherEventsLockWait(t *testing.T) {
	t.Parallel()
	const storeHold = 6 * time.Second
	rdb, prefix := testenv.Redis(t)
	fast, err := redistier.New(rdb, redistier.Config{Prefix: prefix, Timeout: 5 * time.Second}) // a loaded machine opens no breaker here
	require.NoError(t, err)
	h := idHandler{apply: func(string) error { return nil }}
	r := startRigLockTimeout(t, h, fast, "300ms", func(c *consumer.Config) {
		c.Prefetch, c.BatchSize, c.Workers = 16, 1, 4
		c.StoreHold = storeHold
		c.HandlerTimeout = 2 * time.Second
	})
	restoredWithStaleMarkers(t, r, rdb, prefix, "evt_a", "evt_c")

	// C is processed again in the new history, and its marker rewritten.
	stale := markerOf(t, rdb, prefix, "evt_c")
	r.publish("evt_c", "body of evt_c")
	require.Eventually(t, func() bool { return r.stats[guard.OutcomeProcessed.String()].Load() == 3 }, 30*time.Second, 5*time.Millisecond)
	require.Eventually(t, func() bool {
		m := markerOf(t, rdb, prefix, "evt_c")
		return strings.HasPrefix(m, "done:") && m != stale
	}, 10*time.Second, 5*time.Millisecond, "C's marker was never rewritten in the new history")

	release, waiters := lockRows(t, r, "evt_a")
	r.publish("evt_a", "body of evt_a")
	require.Eventually(t, func() bool { return waiters() > 0 }, 10*time.Second, 5*time.Millisecond, "A never waited on its row")
	published := time.Now()
	r.publish("evt_c", "body of evt_c")
	require.Eventually(t, func() bool { return r.stats[guard.OutcomeDuplicateRedis.String()].Load() == 1 },
		2*storeHold, 5*time.Millisecond, "C was never acked")
	s, ok := lastSettlement(r, "evt_c", guard.OutcomeDuplicateRedis)
	require.True(t, ok)
	waited := s.at.Sub(published)
	release()
	require.Less(t, waited, storeHold/3,
		"a duplicate whose marker the store confirmed waited %s for its ack, behind another event's lock wait", waited)
}

// TestEveryDeliveryHeldForALockWaitIsHandedBackWithinStoreHold: after a
// restore, several events' markers are stale and their rows are held by
// another session's open transaction. Each delivery is held in place, and
// must be handed back within StoreHold of its arrival plus one attempt
// (HandlerTimeout), as docs and I11 say, however many are held at once.
func TestEveryDeliveryHeldForALockWaitIsHandedBackWithinStoreHold(t *testing.T) {
	t.Parallel()
	const (
		storeHold      = time.Second
		handlerTimeout = time.Second
	)
	rdb, prefix := testenv.Redis(t)
	fast, err := redistier.New(rdb, redistier.Config{Prefix: prefix, Timeout: 5 * time.Second}) // a loaded machine opens no breaker here
	require.NoError(t, err)
	h := idHandler{apply: func(string) error { return nil }}
	r := startRigLockTimeout(t, h, fast, "300ms", func(c *consumer.Config) {
		c.Prefetch, c.BatchSize, c.Workers = 8, 1, 8
		c.StoreHold = storeHold
		c.HandlerTimeout = handlerTimeout
	})
	ids := []string{"evt_1", "evt_2", "evt_3", "evt_4", "evt_5", "evt_6", "evt_7", "evt_8"}
	restoredWithStaleMarkers(t, r, rdb, prefix, ids...)
	release, _ := lockRows(t, r, ids...)
	defer release()
	for _, id := range ids {
		r.publish(id, "body of "+id)
	}
	handedBack := func() map[string]settledAt {
		out := map[string]settledAt{}
		for _, s := range r.settlements() {
			if _, seen := out[s.EventID]; !seen && s.Outcome == guard.OutcomeRetry && s.Reason == wire.RequeueLockWait {
				out[s.EventID] = s
			}
		}
		return out
	}
	require.Eventually(t, func() bool { return len(handedBack()) == len(ids) }, 30*time.Second, 5*time.Millisecond,
		"not every held delivery was handed back")
	var worst time.Duration
	var worstID string
	for id, s := range handedBack() {
		if held := s.at.Sub(s.Received); held > worst {
			worst, worstID = held, id
		}
	}
	// A second of slack for a loaded machine's scheduling: one delivery
	// held behind the others would take a StoreHold more.
	require.LessOrEqual(t, worst, storeHold+handlerTimeout+time.Second,
		"%s was held %s from its arrival, more than StoreHold (%s) and one attempt (%s)", worstID, worst, storeHold, handlerTimeout)
}

// TestAShutdownWhileTheStoreDoesNotAnswerEndsWithinTheDrain: the store
// stops answering (here: every connection of the consumer's pool is taken,
// as a store that hangs leaves them) while the consumer holds duplicates
// Redis knows, per-event. SIGTERM must end Run within DrainTimeout and a
// bounded roll-back (one attempt, one history read), whatever the number of
// deliveries held: until Run returns, the session's channel stays open and
// keeps every delivery it holds (I7, I11).
func TestAShutdownWhileTheStoreDoesNotAnswerEndsWithinTheDrain(t *testing.T) {
	t.Parallel()
	const (
		n              = 16
		drainTimeout   = time.Second
		handlerTimeout = time.Second
	)
	rdb, prefix := testenv.Redis(t)
	fast, err := redistier.New(rdb, redistier.Config{Prefix: prefix, Timeout: 5 * time.Second}) // a loaded machine opens no breaker here
	require.NoError(t, err)
	h := idHandler{apply: func(string) error { return nil }}
	r, pool, stop := startRigPool(t, h, fast, func(c *pgxpool.Config) { c.MaxConns = 4 }, func(c *consumer.Config) {
		c.Prefetch, c.BatchSize, c.Workers = n, 1, 4
		c.HandlerTimeout, c.DrainTimeout = handlerTimeout, drainTimeout
		c.StoreHold = time.Minute
	})
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("evt_%d", i)
		r.publish(ids[i], "body of "+ids[i])
	}
	require.Eventually(t, func() bool { return r.stats[guard.OutcomeProcessed.String()].Load() == n }, 30*time.Second, 5*time.Millisecond)
	waitForMarkers(t, rdb, prefix, ids...)

	// The store stops answering: nothing of the consumer's pool is free.
	var held []*pgxpool.Conn
	for range int(pool.Config().MaxConns) {
		c, err := pool.Acquire(context.Background())
		require.NoError(t, err)
		held = append(held, c)
	}
	defer func() {
		for _, c := range held {
			c.Release()
		}
	}()
	for _, id := range ids {
		r.publish(id, "body of "+id)
	}
	require.Eventually(t, func() bool { return r.consumerStats().InFlight >= 4 }, 10*time.Second, 5*time.Millisecond)
	time.Sleep(time.Second) // everything the pipeline takes is taken
	took := stop()
	require.Zero(t, r.stats[guard.OutcomeDuplicateRedis.String()].Load(), "a duplicate was acked with the store away")
	// DrainTimeout, then one attempt and one history read (2 s, which runs
	// out whatever the caller's context) to roll back, and some slack: a
	// bound that does not grow with the deliveries held.
	require.Less(t, took, drainTimeout+handlerTimeout+2*2*time.Second+time.Second,
		"Run took %s to return after SIGTERM (DrainTimeout %s), holding its deliveries all along", took, drainTimeout)
}

// keyHandler takes the message ID as the event ID and the body as its
// shard key.
type keyHandler struct{}

func (keyHandler) Decode(m consumer.Message) (guard.Event, string, error) {
	return guard.Event{ID: m.ID, Hash: guard.HashFields(string(m.Body)), ShardKey: string(m.Body)}, m.ID, nil
}

func (keyHandler) Apply(context.Context, pgx.Tx, string) error { return nil }

// shardKeyOn returns a shard key that maps to shard s of n.
func shardKeyOn(s, n int) string {
	for i := 0; ; i++ {
		if k := fmt.Sprintf("user_%d", i); partition.Of(k, n) == s {
			return k
		}
	}
}

// TestOneShardAwayHoldsNoDuplicateOfAnother: with two shards, shard 1's
// store stops answering (every connection of its pool taken) while the
// consumer holds duplicates of both shards that Redis knows. Shard 1's are
// held (the store decides, and does not answer); shard 0's store answers,
// and its duplicates must be acked at once: "with shards, one shard away
// stops nothing else" (holdInPlace).
func TestOneShardAwayHoldsNoDuplicateOfAnother(t *testing.T) {
	t.Parallel()
	const storeHold = 8 * time.Second
	rdb, prefix := testenv.Redis(t)
	fast, err := redistier.New(rdb, redistier.Config{Prefix: prefix, Timeout: 5 * time.Second}) // a loaded machine opens no breaker here
	require.NoError(t, err)
	p0, _ := testenv.Schema(t, testenv.Effects)
	_, u1 := testenv.Schema(t, testenv.Effects)
	c1, err := pgxpool.ParseConfig(u1)
	require.NoError(t, err)
	c1.MaxConns = 2
	p1, err := pgxpool.NewWithConfig(context.Background(), c1)
	require.NoError(t, err)
	t.Cleanup(p1.Close)
	g, err := guard.New(guard.Config{Scope: "svc", Shards: []guard.Store{pgtier.New(p0), pgtier.New(p1)}, Fast: fast})
	require.NoError(t, err)

	url := testenv.AMQPURL()
	r := &rig{t: t, pool: p0, queue: testenv.Queue(t, url), stats: map[string]*atomic.Int64{}}
	for _, o := range guard.Outcomes() {
		r.stats[o.String()] = &atomic.Int64{}
	}
	for _, name := range wire.Counters() {
		r.stats[name] = &atomic.Int64{}
	}
	cfg := consumer.Config{
		URL: url, Queue: r.queue, Workers: 2, Prefetch: 32, DeliveryLimit: 2,
		BatchSize: 16, BatchLinger: 20 * time.Millisecond,
		HandlerTimeout: time.Second, StoreHold: storeHold,
		RetryBackoff: consumer.Backoff{Min: 10 * time.Millisecond, Max: 50 * time.Millisecond},
		Observer:     r,
		Logger:       slog.New(slog.DiscardHandler),
	}
	c, err := consumer.New(cfg, g, keyHandler{})
	require.NoError(t, err)
	conn, err := amqp.Dial(url)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	r.ch, err = conn.Channel()
	require.NoError(t, err)
	require.NoError(t, broker.TopologyFor(cfg.Queue, cfg.BrokerDeliveryLimit).Declare(r.ch))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })

	k0, k1 := shardKeyOn(0, 2), shardKeyOn(1, 2)
	var on0, on1 []string
	for i := range 4 {
		on0 = append(on0, fmt.Sprintf("evt_s0_%d", i))
		on1 = append(on1, fmt.Sprintf("evt_s1_%d", i))
	}
	publishAll := func(ids []string, key string) {
		for _, id := range ids {
			r.publish(id, key)
		}
	}
	publishAll(on0, k0)
	publishAll(on1, k1)
	require.Eventually(t, func() bool { return r.stats[guard.OutcomeProcessed.String()].Load() == 8 }, 30*time.Second, 5*time.Millisecond)
	require.Eventually(t, func() bool {
		for _, id := range append(slices.Clone(on0), on1...) {
			if !strings.HasPrefix(markerOf(t, rdb, prefix, id), "done:") {
				return false
			}
		}
		return true
	}, 10*time.Second, 5*time.Millisecond, "the done markers were never written")

	// Shard 1's store stops answering.
	var held []*pgxpool.Conn
	for range int(c1.MaxConns) {
		c, err := p1.Acquire(context.Background())
		require.NoError(t, err)
		held = append(held, c)
	}
	defer func() {
		for _, c := range held {
			c.Release()
		}
	}()
	publishAll(on1, k1)
	time.Sleep(200 * time.Millisecond) // a batch of their own, screened first
	published := time.Now()
	publishAll(on0, k0)
	require.Eventually(t, func() bool { return r.stats[guard.OutcomeDuplicateRedis.String()].Load() == int64(len(on0)) },
		3*storeHold, 5*time.Millisecond, "shard 0's duplicates were never acked")
	var last time.Time
	for _, id := range on0 {
		s, ok := lastSettlement(r, id, guard.OutcomeDuplicateRedis)
		require.True(t, ok)
		if s.at.After(last) {
			last = s.at
		}
	}
	waited := last.Sub(published)
	require.Less(t, waited, storeHold/2,
		"shard 0's duplicates, whose store answers, waited %s for their acks behind shard 1's hold", waited)
}
