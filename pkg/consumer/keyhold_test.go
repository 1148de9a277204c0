package consumer_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
)

// awayHandler is a keyedHandler whose store is away for the events away
// names.
type awayHandler struct {
	*keyedHandler
	away func(id string) bool
}

func (h awayHandler) Apply(ctx context.Context, tx pgx.Tx, id string) error {
	if h.away(id) {
		return &pgconn.PgError{Code: "57P01", Message: "terminating connection due to administrator command"}
	}
	return h.keyedHandler.Apply(ctx, tx, id)
}

// TestKeyOrderHoldsAKeyWhoseEventWasHandedBack: with KeyOrder, an event held
// in place past StoreHold goes back to the queue. The later events of its
// key, received meanwhile, must not be applied before it comes back (they
// were: [a:2 a:3 a:1]); they go back after it, and other keys go on. With
// batches, the held key's events leave a screened batch whose other events
// are applied.
func TestKeyOrderHoldsAKeyWhoseEventWasHandedBack(t *testing.T) {
	t.Parallel()
	for _, batchSize := range []int{1, 2} {
		t.Run(fmt.Sprintf("batch size %d", batchSize), func(t *testing.T) {
			t.Parallel()
			// a:1 meets a store that is away until it was handed back once.
			var retried atomic.Pointer[atomic.Int64]
			h := awayHandler{keyedHandler: &keyedHandler{}, away: func(id string) bool {
				n := retried.Load()
				return id == "a:1" && (n == nil || n.Load() == 0)
			}}
			r := startRig(t, consumer.Handler[string](h), func(c *consumer.Config) {
				c.KeyOrder = true
				c.Workers, c.Prefetch, c.BatchSize = 2, 8, batchSize
				c.BatchLinger = 50 * time.Millisecond
				c.StoreHold = 500 * time.Millisecond
				c.DeliveryLimit = 3
			})
			retried.Store(r.stats[guard.OutcomeRetry.String()])
			_, err := r.pool.Exec(context.Background(), `CREATE TABLE applied (id text NOT NULL, n bigserial)`)
			require.NoError(t, err)
			r.publish("a:1", "body of a:1")
			// Held in place, or already handed back: a loaded machine can
			// reach a:1's first attempt past StoreHold from its arrival,
			// which hands it back without a retry in place. Either way its
			// key is held from here on.
			require.Eventually(t, func() bool {
				return r.stats[wire.CounterStoreRetry].Load() > 0 || r.stats[guard.OutcomeRetry.String()].Load() > 0
			}, 30*time.Second, 5*time.Millisecond, "a:1 was neither held in place nor handed back")
			for _, id := range []string{"a:2", "b:1", "a:3"} {
				r.publish(id, "body of "+id)
			}
			require.Eventually(t, func() bool { return r.stats[guard.OutcomeProcessed.String()].Load() == 4 }, 30*time.Second, 10*time.Millisecond)
			var keyA []string
			for _, id := range r.committed() {
				if strings.HasPrefix(id, "a:") {
					keyA = append(keyA, id)
				}
			}
			require.Equal(t, []string{"a:1", "a:2", "a:3"}, keyA, "a later event of a key was applied before the earlier one handed back")
			require.Contains(t, r.committed(), "b:1")
			require.Positive(t, r.stats[guard.OutcomeRetry.String()].Load())
		})
	}
}
