package idem_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/idem"
)

// ledgerHandler applies "id" as a ledger row; stall, if set, runs inside
// the transaction first.
type ledgerHandler struct {
	stall func(ctx context.Context, id string)
}

func (ledgerHandler) Decode(m consumer.Message) (guard.Event, string, error) {
	return guard.Event{ID: m.ID, Hash: guard.HashFields(string(m.Body)), Time: time.Now()}, m.ID, nil
}

func (h ledgerHandler) Apply(ctx context.Context, tx pgx.Tx, id string) error {
	if h.stall != nil {
		h.stall(ctx, id)
	}
	_, err := tx.Exec(ctx, `INSERT INTO ledger (event_id, user_id, amount) VALUES ($1, 'u', 1)`, id)
	return err
}

// linkedSchema makes a schema of the test's own with the test handler's
// tables, and a fault link to its server.
func linkedSchema(t *testing.T) (*pgxpool.Pool, string, *sandbox.Link) {
	t.Helper()
	db, dbURL := testenv.Schema(t, testenv.Effects)
	return db, dbURL, faultLink(t, "postgres", dbURL)
}

// faultLink starts a fault link of the test's own in front of the server
// that rawURL (postgres://, redis:// or amqp://) names; it stops at the end.
func faultLink(t *testing.T, name, rawURL string) *sandbox.Link {
	t.Helper()
	u, err := url.Parse(rawURL)
	require.NoError(t, err)
	faults := sandbox.StartFaults()
	t.Cleanup(faults.Close)
	link, err := faults.Link(name, u.Host)
	require.NoError(t, err)
	return link
}

// viaLink returns rawURL with its host and port replaced by the link's.
func viaLink(t *testing.T, rawURL string, l *sandbox.Link) string {
	u, err := url.Parse(rawURL)
	require.NoError(t, err)
	u.Host = l.Addr()
	return u.String()
}

// runService runs a Service of h until the test ends or stop is called.
func runService(t *testing.T, cfg idem.Config, h ledgerHandler) (svc *idem.Service[string], stop func()) {
	t.Helper()
	cfg.Logger = slog.New(slog.DiscardHandler)
	if testing.Verbose() {
		cfg.Logger = slog.Default()
	}
	svc, err := idem.New(cfg, h)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = svc.Run(ctx) }()
	var once atomic.Bool
	stop = func() {
		if once.Swap(true) {
			return
		}
		cancel()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Error("the service did not stop")
		}
	}
	t.Cleanup(stop)
	return svc, stop
}

// TestAnOrphanedSessionNeverWedgesAHealthyConsumer: consumer A's link to
// Postgres goes silent (packets dropped, nothing closed) while its
// transaction holds the claimed row of e1. The server keeps that session,
// idle in transaction, with the row locked. Consumer B, healthy, gets e1
// once A hands it back: its claim must not wait on the orphan for ever (nor
// spend e1's attempts into the dead-letter queue): the server ends the
// orphaned session within the handler timeout and a margin, and B applies
// e1 once.
func TestAnOrphanedSessionNeverWedgesAHealthyConsumer(t *testing.T) {
	db, dbURL, link := linkedSchema(t)
	amqpURL := testenv.AMQPURL()
	queue := testenv.Queue(t, amqpURL)

	inside := make(chan struct{})
	var stalled atomic.Bool
	a := ledgerHandler{stall: func(ctx context.Context, id string) {
		if id == "e1" && !stalled.Swap(true) {
			close(inside)
			<-ctx.Done() // the link goes silent meanwhile
		}
	}}
	cons := consumer.Config{URL: amqpURL, Queue: queue, HandlerTimeout: 2 * time.Second, StoreHold: 3 * time.Second,
		DeliveryLimit: 3, BatchSize: 1}
	_, stopA := runService(t, idem.Config{Scope: "pay", DatabaseURL: viaLink(t, dbURL, link), Consumer: cons}, a)
	require.Eventually(t, func() bool { return testenv.QueueDepth(t, amqpURL, queue) >= 0 }, 20*time.Second, 50*time.Millisecond,
		"consumer A declared its queue")
	publishIDs(t, amqpURL, queue, "e1")
	select {
	case <-inside:
	case <-time.After(20 * time.Second):
		t.Fatal("consumer A never applied e1")
	}
	require.NoError(t, link.Blackhole())
	t.Cleanup(func() { _ = link.Heal() })

	// A's session is now orphaned, idle in transaction, e1's row locked.
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, db.QueryRow(context.Background(),
			`SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' AND datname = current_database() AND pid <> pg_backend_pid()`).Scan(&n))
		return n > 0
	}, 10*time.Second, 50*time.Millisecond, "A's session idles in its transaction")

	runService(t, idem.Config{Scope: "pay", DatabaseURL: dbURL, Consumer: cons}, ledgerHandler{})
	// A hands e1 back after StoreHold; B takes it and must apply it once
	// the server has ended A's session.
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, db.QueryRow(context.Background(), `SELECT count(*) FROM ledger WHERE event_id = 'e1'`).Scan(&n))
		return n == 1
	}, 45*time.Second, 100*time.Millisecond, "e1 applied by the healthy consumer")
	stopA()
	require.Equal(t, 0, testenv.QueueDepth(t, amqpURL, queue+".dlq"), "nothing dead-lettered")
}

// publishIDs publishes one message per id to queue (see publisher).
func publishIDs(t *testing.T, amqpURL, queue string, ids ...string) {
	t.Helper()
	publisher(t, amqpURL, queue)(ids...)
}

// publisher returns a func that publishes one message per id to queue, the
// id its message ID and body, each confirmed by the broker. Its connection
// closes at the end of the test.
func publisher(t *testing.T, amqpURL, queue string) func(ids ...string) {
	t.Helper()
	conn, err := amqp.Dial(amqpURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	return func(ids ...string) {
		t.Helper()
		for _, id := range ids {
			require.NoError(t, publishID(ch, queue, id), "the broker's confirm of %s", id)
		}
	}
}

// publishID publishes one message to queue on ch, a channel in confirm
// mode, id its message ID and body, within ten seconds. A nack (a quorum
// queue busy on a loaded machine) means the broker did not take it: it is
// sent again, as a producer does.
func publishID(ch *amqp.Channel, queue, id string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for {
		c, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, false, false,
			amqp.Publishing{MessageId: id, Body: []byte(id), Timestamp: time.Now()})
		if err != nil {
			return err
		}
		if acked, err := c.WaitContext(ctx); acked || err != nil {
			return err
		}
	}
}

// TestAConsumerCutOffFromItsStoreHandsBackWhatItHolds: consumer A's link to
// Postgres goes silent and stays so; B is healthy. A must not keep its
// prefetch: every delivery it took is back in the queue, and applied by B,
// within StoreHold of its arrival (and a margin), while A's link is still
// silent; and A takes no more until its store answers.
func TestAConsumerCutOffFromItsStoreHandsBackWhatItHolds(t *testing.T) {
	db, dbURL, link := linkedSchema(t)
	amqpURL := testenv.AMQPURL()
	queue := testenv.Queue(t, amqpURL)

	const storeHold = 3 * time.Second
	cons := consumer.Config{URL: amqpURL, Queue: queue, HandlerTimeout: time.Second, StoreHold: storeHold,
		BatchSize: 1, Prefetch: 100}
	runService(t, idem.Config{Scope: "pay", DatabaseURL: viaLink(t, dbURL, link), Consumer: cons}, ledgerHandler{})
	require.Eventually(t, func() bool { return testenv.QueueDepth(t, amqpURL, queue) >= 0 }, 20*time.Second, 50*time.Millisecond)
	require.NoError(t, link.Blackhole())
	t.Cleanup(func() { _ = link.Heal() })
	runService(t, idem.Config{Scope: "pay", DatabaseURL: dbURL, Consumer: cons}, ledgerHandler{})

	ids := make([]string, 60)
	for i := range ids {
		ids[i] = fmt.Sprintf("e%02d", i)
	}
	publishIDs(t, amqpURL, queue, ids...)
	published := time.Now()
	var applied int
	require.Eventually(t, func() bool {
		require.NoError(t, db.QueryRow(context.Background(), `SELECT count(DISTINCT event_id) FROM ledger`).Scan(&applied))
		return applied == len(ids)
	}, 60*time.Second, 100*time.Millisecond)
	took := time.Since(published)
	require.Less(t, took, storeHold+5*time.Second, "every event applied within store_hold of its arrival and a margin, while A's link is down (took %s)", took)
	var doubled int
	require.NoError(t, db.QueryRow(context.Background(), `SELECT count(*) - count(DISTINCT event_id) FROM ledger`).Scan(&doubled))
	require.Zero(t, doubled)
}
