package consumer_test

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/pgsession"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/partition"
)

// balanceHandler credits the user named by the body: one business row per
// user, updated in the guard's transaction.
type balanceHandler struct{}

func (balanceHandler) Decode(m consumer.Message) (guard.Event, string, error) {
	return guard.Event{ID: m.ID, Hash: guard.HashFields(string(m.Body)), Time: time.Now()}, string(m.Body), nil
}

func (balanceHandler) Apply(ctx context.Context, tx pgx.Tx, user string) error {
	if _, err := tx.Exec(ctx, `UPDATE balances SET balance = balance + 1 WHERE user_id = $1`, user); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, `INSERT INTO ledger (event_id, user_id, amount) VALUES ($1, $1, 1)`, user)
	return err
}

// reviewBoundedPool is a pool on a schema of the test's own, its sessions
// bounded as idem.Service and `idem consume` bound theirs.
func reviewBoundedPool(t *testing.T, handlerTimeout time.Duration) (*pgxpool.Pool, string) {
	t.Helper()
	_, dbURL := testenv.Schema(t, testenv.Effects)
	pc, err := pgxpool.ParseConfig(dbURL)
	require.NoError(t, err)
	pgsession.Apply(pc, pgsession.Bounds{Tx: handlerTimeout})
	pool, err := pgxpool.NewWithConfig(context.Background(), pc)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool, dbURL
}

// TestOneLockedRowDoesNotHoldItsWholeBatch: a batch of four events,
// each crediting its own user's balance row. A healthy peer (another
// service's long transaction, a report, an operator's SELECT … FOR UPDATE)
// holds u3's row for 30 s. Before lock_timeout, e3's wait ran into the
// handler timeout, an attempt of the batch's own: the batch split, e1, e2
// and e4 committed within a few handler timeouts, and e3 alone took the
// retry path. Now lock_timeout (HandlerTimeout / 2) ends the wait with
// 55P03, which classify makes a hold for the whole batch before any split:
// the three innocent events are held with it for StoreHold, then handed
// back with it, and come back to meet the same lock.
func TestOneLockedRowDoesNotHoldItsWholeBatch(t *testing.T) {
	t.Parallel()
	const handlerTimeout = time.Second
	pool, dbURL := reviewBoundedPool(t, handlerTimeout)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `INSERT INTO balances (user_id) VALUES ('u1'), ('u2'), ('u3'), ('u4')`)
	require.NoError(t, err)

	// The healthy peer: a session of its own, not idem's.
	peer, err := pgx.Connect(ctx, dbURL)
	require.NoError(t, err)
	t.Cleanup(func() { peer.Close(context.Background()) })
	peerTx, err := peer.Begin(ctx)
	require.NoError(t, err)
	_, err = peerTx.Exec(ctx, `SELECT 1 FROM balances WHERE user_id = 'u3' FOR UPDATE`)
	require.NoError(t, err)
	released := false
	release := func() {
		if !released {
			released = true
			_ = peerTx.Rollback(context.Background())
		}
	}
	t.Cleanup(release)

	url := testenv.AMQPURL()
	queue := testenv.Queue(t, url)
	g, err := guard.New(guard.Config{Scope: "svc", Store: pgtier.New(pool)})
	require.NoError(t, err)
	c, err := consumer.New(consumer.Config{
		URL: url, Queue: queue, Workers: 1, Prefetch: 4, BatchSize: 4, BatchLinger: 300 * time.Millisecond,
		HandlerTimeout: handlerTimeout, StoreHold: 20 * time.Second, DeliveryLimit: 5,
		RetryBackoff: consumer.Backoff{Min: 10 * time.Millisecond, Max: 50 * time.Millisecond},
		Logger:       slog.New(slog.DiscardHandler),
	}, g, balanceHandler{})
	require.NoError(t, err)
	conn, err := amqp.Dial(url)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, broker.TopologyFor(queue, 0).Declare(ch))
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	t.Cleanup(func() { release(); cancel(); <-done })

	for i := 1; i <= 4; i++ {
		require.NoError(t, ch.PublishWithContext(ctx, "", queue, false, false, amqp.Publishing{
			MessageId: fmt.Sprintf("e%d", i), Body: fmt.Appendf(nil, "u%d", i), Timestamp: time.Now(), DeliveryMode: amqp.Persistent,
		}))
	}
	applied := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM ledger WHERE user_id IN ('u1', 'u2', 'u4')`).Scan(&n))
		return n
	}
	require.Eventually(t, func() bool { return applied() == 3 }, 10*time.Second, 50*time.Millisecond,
		"e1, e2 and e4 (their rows free) held hostage by e3's locked row: %d of 3 applied", applied())
	release()
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM ledger WHERE user_id = 'u3'`).Scan(&n))
		return n == 1
	}, 30*time.Second, 50*time.Millisecond)
}

// shardedHandler applies an event on the shard of its user (the body).
type shardedHandler struct{}

func (shardedHandler) Decode(m consumer.Message) (guard.Event, string, error) {
	return guard.Event{ID: m.ID, Hash: guard.HashFields(string(m.Body)), Time: time.Now(), ShardKey: string(m.Body)}, m.ID, nil
}

func (shardedHandler) Apply(ctx context.Context, tx pgx.Tx, id string) error {
	_, err := tx.Exec(ctx, `INSERT INTO ledger (event_id, user_id, amount) VALUES ($1, 'u', 1)`, id)
	return err
}

// reviewUserOn returns a shard key that routes to shard k of n.
func reviewUserOn(t *testing.T, k, n int) string {
	for i := range 1000 {
		if u := fmt.Sprintf("user-%d", i); partition.Of(u, n) == k {
			return u
		}
	}
	t.Fatal("no key for the shard")
	return ""
}

// TestOneShardDownDoesNotStopTheOthers: two shards; shard 1's
// PostgreSQL is down, shard 0's is healthy. An event for shard 1 is held
// for StoreHold and handed back, as before; but now the hold's end also
// ends the session (storeAway), and awaitStore pings every shard before the
// next one: the consumer takes no delivery at all while shard 1 is down,
// and events for the healthy shard 0 wait with it. Every consumer of the
// fleet meets a shard-1 event sooner or later, so one shard's outage stops
// the whole stream. Before, shard 0's events went on being applied.
func TestOneShardDownDoesNotStopTheOthers(t *testing.T) {
	t.Parallel()
	up, _ := testenv.Schema(t, testenv.Effects)
	downCfg, err := pgxpool.ParseConfig("postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=1")
	require.NoError(t, err)
	down, err := pgxpool.NewWithConfig(context.Background(), downCfg) // connects lazily
	require.NoError(t, err)
	t.Cleanup(down.Close)

	url := testenv.AMQPURL()
	queue := testenv.Queue(t, url)
	g, err := guard.New(guard.Config{Scope: "svc", Shards: []guard.Store{pgtier.New(up), pgtier.New(down)}})
	require.NoError(t, err)
	c, err := consumer.New(consumer.Config{
		URL: url, Queue: queue, Workers: 2, Prefetch: 10, BatchSize: 1,
		HandlerTimeout: time.Second, StoreHold: 2 * time.Second,
		RetryBackoff: consumer.Backoff{Min: 10 * time.Millisecond, Max: 100 * time.Millisecond},
		Logger:       slog.New(slog.DiscardHandler),
	}, g, shardedHandler{})
	require.NoError(t, err)
	conn, err := amqp.Dial(url)
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, broker.TopologyFor(queue, 0).Declare(ch))
	ctx := context.Background()
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	t.Cleanup(func() { cancel(); <-done })
	publish := func(id, user string) {
		require.NoError(t, ch.PublishWithContext(ctx, "", queue, false, false, amqp.Publishing{
			MessageId: id, Body: []byte(user), Timestamp: time.Now(), DeliveryMode: amqp.Persistent,
		}))
	}

	publish("on-down-shard", reviewUserOn(t, 1, 2))
	time.Sleep(4 * time.Second) // past StoreHold: the event went back once
	for i := range 3 {
		publish(fmt.Sprintf("on-up-shard-%d", i), reviewUserOn(t, 0, 2))
	}
	var n int
	require.Eventually(t, func() bool {
		require.NoError(t, up.QueryRow(ctx, `SELECT count(*) FROM ledger`).Scan(&n))
		return n == 3
	}, 15*time.Second, 50*time.Millisecond, "the healthy shard's events: %d of 3 applied; consuming: %v", n, c.Stats().Consuming)
}
