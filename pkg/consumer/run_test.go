package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/fastkey"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/redistier"
)

// handlerFunc adapts two funcs to consumer.Handler[[]byte]. Decode uses the
// AMQP message ID as the event ID, as a service that keys on it would.
type handlerFunc struct {
	apply func(ctx context.Context, tx pgx.Tx) error
}

func (h handlerFunc) Decode(m consumer.Message) (guard.Event, []byte, error) {
	return guard.Event{ID: m.ID, Hash: guard.HashFields(string(m.Body))}, m.Body, nil
}

func (h handlerFunc) Apply(ctx context.Context, tx pgx.Tx, _ []byte) error { return h.apply(ctx, tx) }

// rig runs one in-process Consumer on a queue and schema of the test's own.
type rig struct {
	t     *testing.T
	pool  *pgxpool.Pool
	queue string
	ch    *amqp.Channel
	stats map[string]*atomic.Int64 // deliveries by outcome, and Counter* counts
	// consumerStats is the consumer's Stats.
	consumerStats func() consumer.Stats
	// ended closes when Run returns, before the test's end only if it
	// returned on its own.
	ended <-chan struct{}

	mu      sync.Mutex
	settled []settledAt // every settlement, in order
}

// settledAt is a Settlement and when it happened.
type settledAt struct {
	consumer.Settlement
	at time.Time
}

// Settled, Count and Gathered make the rig the consumer's Observer.
func (r *rig) Settled(_ context.Context, s consumer.Settlement) {
	r.stats[s.Outcome.String()].Add(1)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.settled = append(r.settled, settledAt{s, time.Now()})
}

// settlements returns the settlements so far.
func (r *rig) settlements() []settledAt {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.settled)
}
func (r *rig) Count(name string, n int) { r.stats[name].Add(int64(n)) }
func (r *rig) Gathered(int)             {}

func startRig[T any](t *testing.T, h consumer.Handler[T], tune func(*consumer.Config)) *rig {
	t.Helper()
	return startRigWith(t, h, nil, tune)
}

// startRigWith is startRig with a fast tier in front of the store.
func startRigWith[T any](t *testing.T, h consumer.Handler[T], fast guard.FastPath, tune func(*consumer.Config)) *rig {
	t.Helper()
	r, _, _ := startRigPool(t, h, fast, nil, tune)
	return r
}

func (r *rig) publish(id, body string) {
	r.t.Helper()
	require.NoError(r.t, r.ch.PublishWithContext(context.Background(), "", r.queue, false, false, amqp.Publishing{
		MessageId: id, Body: []byte(body), Timestamp: time.Now(), DeliveryMode: amqp.Persistent,
	}))
}

// deadLetter waits for the next dead letter and returns it.
func (r *rig) deadLetter() amqp.Delivery {
	r.t.Helper()
	var d amqp.Delivery
	require.Eventually(r.t, func() bool {
		var ok bool
		var err error
		d, ok, err = r.ch.Get(r.queue+".dlq", true)
		require.NoError(r.t, err)
		return ok
	}, 30*time.Second, 10*time.Millisecond, "no dead letter")
	return d
}

// TestFailuresThatAreTheEventsOwnSpendItsBudget: a handler that outlasts
// its timeout by calling a slow downstream, and one that swallows a failed
// statement so that COMMIT rolls back, are the event's failures, not the
// store's: each attempt counts and the message is dead-lettered after
// DeliveryLimit attempts, not retried in place forever.
func TestFailuresThatAreTheEventsOwnSpendItsBudget(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name   string
		apply  func(ctx context.Context, tx pgx.Tx) error
		reason string
	}{
		{"slow downstream honouring ctx", func(ctx context.Context, _ pgx.Tx) error {
			select { // a downstream call that takes longer than the handler may
			case <-time.After(10 * time.Second):
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}, wire.ReasonHandlerTimeout},
		{"query outlasting the timeout", func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `SELECT pg_sleep(10)`)
			return err
		}, wire.ReasonHandlerTimeout},
		{"failed statement swallowed, COMMIT rolls back", func(ctx context.Context, tx pgx.Tx) error {
			_, _ = tx.Exec(ctx, `SELECT 1/0`) // the handler ignores the error; the tx is now aborted
			return nil
		}, wire.ReasonCommitFailed},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			var attempts atomic.Int64
			r := startRig(t, handlerFunc{apply: func(ctx context.Context, tx pgx.Tx) error {
				attempts.Add(1)
				return c.apply(ctx, tx)
			}}, func(cfg *consumer.Config) {
				// After a timeout the consumer pings the store for half
				// of this before it counts the attempt; half a second
				// was once too little beside a chaos run on two cores,
				// and the attempt was held as the store's instead.
				cfg.HandlerTimeout = 3 * time.Second
			})
			r.publish("evt_1", "x")
			d := r.deadLetter()
			require.Equal(t, c.reason, d.Headers[wire.HeaderReason])
			require.Equal(t, int64(2), d.Headers[wire.HeaderDeliveryCount])
			require.Equal(t, int64(2), attempts.Load(), "one attempt per delivery, DeliveryLimit deliveries")
			var rows int
			require.NoError(t, r.pool.QueryRow(context.Background(), `SELECT count(*) FROM idem_processed`).Scan(&rows))
			require.Zero(t, rows, "nothing of a failed attempt commits")
		})
	}
}

// TestDecodeSeesTheMessageID: a service can key idempotency on the AMQP
// message ID rather than on anything in the body.
func TestDecodeSeesTheMessageID(t *testing.T) {
	t.Parallel()
	var applied atomic.Int64
	r := startRig(t, handlerFunc{apply: func(context.Context, pgx.Tx) error {
		applied.Add(1)
		return nil
	}}, nil)
	r.publish("msg-1", "same body")
	r.publish("msg-1", "same body")
	r.publish("msg-2", "same body")
	require.Eventually(t, func() bool {
		// The two copies of msg-1 may meet in one batch (duplicate_batch)
		// or not (duplicate_postgres).
		return r.stats["processed"].Load()+r.stats["duplicate_postgres"].Load()+r.stats["duplicate_batch"].Load() == 3
	}, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, int64(2), applied.Load())
	r.publish("msg-1", "other body")
	d := r.deadLetter()
	require.Equal(t, wire.ReasonPayloadConflict, d.Headers[wire.HeaderReason])
}

// batchHandler fails any batch that holds a "poison" body, as a set-based
// statement fails for one bad row.
type batchHandler struct{ handlerFunc }

func (h batchHandler) Apply(ctx context.Context, tx pgx.Tx, v []byte) error {
	return h.ApplyBatch(ctx, tx, [][]byte{v})
}

func (batchHandler) ApplyBatch(ctx context.Context, tx pgx.Tx, vs [][]byte) error {
	bodies := make([]string, len(vs))
	for i, v := range vs {
		if string(v) == "poison" {
			return errors.New("poison in the batch")
		}
		bodies[i] = string(v)
	}
	_, err := tx.Exec(ctx, `INSERT INTO ledger (event_id, user_id, amount) SELECT b, 'u', 1 FROM unnest($1::text[]) AS t(b)`, bodies)
	return err
}

// TestOneBadEventNeverSinksItsBatch: a batch whose handler fails is split
// until the failing event stands alone; the others commit once, and only the
// bad one spends its attempts and is dead-lettered.
func TestOneBadEventNeverSinksItsBatch(t *testing.T) {
	t.Parallel()
	r := startRig(t, batchHandler{}, func(cfg *consumer.Config) {
		cfg.Prefetch, cfg.BatchSize, cfg.BatchLinger = 16, 16, 50*time.Millisecond
	})
	for i := range 15 {
		if i == 7 {
			r.publish("evt_poison", "poison")
		}
		r.publish(fmt.Sprintf("evt_%d", i), fmt.Sprintf("body_%d", i))
	}
	d := r.deadLetter()
	require.Equal(t, "evt_poison", d.MessageId)
	require.Equal(t, wire.ReasonHandlerFailed, d.Headers[wire.HeaderReason])
	require.Eventually(t, func() bool { return r.stats["processed"].Load() == 15 }, 30*time.Second, 10*time.Millisecond)
	var rows, distinct int
	require.NoError(t, r.pool.QueryRow(context.Background(), `SELECT count(*), count(DISTINCT event_id) FROM ledger`).Scan(&rows, &distinct))
	require.Equal(t, 15, rows)
	require.Equal(t, 15, distinct)
	require.Positive(t, r.stats[wire.CounterBatchSplit].Load())
}

// TestLeasedEventsAreDeferredNeitherDroppedNorDoubled: events whose Redis
// lease another consumer holds are set aside and screened again, every copy
// together; the holder here never commits (it crashed), so the second
// screening sends them to Postgres, which processes each once.
func TestLeasedEventsAreDeferredNeitherDroppedNorDoubled(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	fast, err := redistier.New(rdb, redistier.Config{Prefix: prefix})
	require.NoError(t, err)
	for i := range 10 {
		require.NoError(t, rdb.Set(context.Background(), fastkey.Key(prefix, "svc", fmt.Sprintf("evt_l%d", i)), "pending:ghost", time.Minute).Err())
	}
	r := startRigWith(t, batchHandler{}, fast, func(cfg *consumer.Config) {
		cfg.Prefetch, cfg.BatchSize, cfg.BatchLinger = 64, 16, 20*time.Millisecond
	})
	// The second copies come a batch later, so that they meet the first
	// copies' deferral.
	for _, other := range []string{"evt_a", "evt_b"} {
		for i := range 10 {
			leased := fmt.Sprintf("evt_l%d", i)
			r.publish(leased, leased)
			r.publish(fmt.Sprintf("%s%d", other, i), fmt.Sprintf("%s%d", other, i))
		}
	}
	require.Eventually(t, func() bool {
		var n int64
		for _, o := range guard.Outcomes() {
			n += r.stats[o.String()].Load()
		}
		return n == 40
	}, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, int64(30), r.stats["processed"].Load())
	require.Equal(t, int64(10), r.stats["duplicate_batch"].Load()+r.stats["duplicate_postgres"].Load()+r.stats["duplicate_redis"].Load())
	require.Zero(t, r.stats["retry"].Load())
	var rows, distinct int
	require.NoError(t, r.pool.QueryRow(context.Background(), `SELECT count(*), count(DISTINCT event_id) FROM ledger`).Scan(&rows, &distinct))
	require.Equal(t, 30, rows)
	require.Equal(t, 30, distinct)
	require.Positive(t, r.stats[wire.CounterDeferred].Load())
}
