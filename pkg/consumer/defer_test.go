package consumer_test

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard/redistier"
)

// holdingHandler applies batches as batchHandler does, but holds the
// transaction of a batch holding "hold" open (its rows locked) until
// release is closed; pid is that transaction's backend.
type holdingHandler struct {
	batchHandler
	pid     *atomic.Int64
	release chan struct{}
}

func (h holdingHandler) Apply(ctx context.Context, tx pgx.Tx, v []byte) error {
	return h.ApplyBatch(ctx, tx, [][]byte{v})
}

func (h holdingHandler) ApplyBatch(ctx context.Context, tx pgx.Tx, vs [][]byte) error {
	if slices.ContainsFunc(vs, func(v []byte) bool { return string(v) == "hold" }) {
		var pid int64
		if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			return err
		}
		h.pid.Store(pid)
		select {
		case <-h.release:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return h.batchHandler.ApplyBatch(ctx, tx, vs)
}

// TestDeferredEventsWaitForTheBatchThatHoldsTheirLease: a batch's copies of
// events whose lease a batch of the same worker holds, still being decided,
// are deferred; with the broker's window full, no next batch comes. They
// must wait for that batch rather than go to the store on their own, where
// their claims would wait on its rows, a transaction spent on duplicates.
func TestDeferredEventsWaitForTheBatchThatHoldsTheirLease(t *testing.T) {
	t.Parallel()
	const linger = 50 * time.Millisecond
	rdb, prefix := testenv.Redis(t)
	fast, err := redistier.New(rdb, redistier.Config{Prefix: prefix, Timeout: 5 * time.Second})
	require.NoError(t, err)
	h := holdingHandler{pid: &atomic.Int64{}, release: make(chan struct{})}
	release := sync.OnceFunc(func() { close(h.release) })
	r := startRigWith(t, h, fast, func(cfg *consumer.Config) {
		cfg.Prefetch, cfg.BatchSize, cfg.BatchLinger, cfg.Workers = 8, 4, linger, 2
		cfg.HandlerTimeout = 30 * time.Second
	})
	t.Cleanup(release) // runs before the rig's: a failure does not wait out the drain
	ids := []string{"evt_1", "evt_2", "evt_3", "evt_4"}
	body := func(id string) string {
		if id == "evt_1" {
			return "hold"
		}
		return id
	}
	for _, id := range ids {
		r.publish(id, body(id))
	}
	require.Eventually(t, func() bool { return h.pid.Load() != 0 }, 30*time.Second, 5*time.Millisecond, "the first batch never reached its handler")
	for _, id := range ids {
		r.publish(id, body(id))
	}
	require.Eventually(t, func() bool { return r.stats[wire.CounterDeferred].Load() > 0 }, 30*time.Second, 5*time.Millisecond,
		"the copies were never deferred")

	// Sent on their own, the copies would wait on the held batch's rows a
	// BatchLinger after their deferral. They may go after 20 lingers (1 s)
	// at most, so that 8 lingers of none is well inside it.
	waiters := func() int { return blockedBy(t, r.pool, int(h.pid.Load())) }
	for end := time.Now().Add(8 * linger); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		require.Zero(t, waiters(), "the deferred copies went to the store on their own while their lease's batch was being decided")
	}
	// The wait is bounded: with the batch still held, the copies go to the
	// store after 20 lingers, where their claims wait on its rows.
	require.Eventually(t, func() bool { return waiters() > 0 }, 10*time.Second, 5*time.Millisecond,
		"the deferred copies waited for their lease's batch without bound")
	release()

	require.Eventually(t, func() bool {
		var n int64
		for _, o := range []string{"processed", "duplicate_batch", "duplicate_redis", "duplicate_postgres"} {
			n += r.stats[o].Load()
		}
		return n == 8
	}, 30*time.Second, 5*time.Millisecond)
	require.Equal(t, int64(4), r.stats["processed"].Load())
	r.requireLedger(4)
}
