package consumer_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
)

// idHandler decodes the AMQP message ID as both the event ID and the value,
// and applies with apply.
type idHandler struct {
	apply func(id string) error
}

func (h idHandler) Decode(m consumer.Message) (guard.Event, string, error) {
	return guard.Event{ID: m.ID, Hash: guard.HashFields(string(m.Body))}, m.ID, nil
}

func (h idHandler) Apply(_ context.Context, _ pgx.Tx, id string) error { return h.apply(id) }

// TestAHoldIsBoundedPerDeliveryThroughSplits: a batch fails on its own and is
// split; its halves then meet a store that is away. Every delivery must be
// handed back within one StoreHold of the batch's first hold, not one
// StoreHold per half.
func TestAHoldIsBoundedPerDeliveryThroughSplits(t *testing.T) {
	t.Parallel()
	const storeHold = time.Second
	var booms, phase atomic.Int32 // phase 0: e4 fails; 1: the store is away; 2: all well
	away := &pgconn.PgError{Code: "57P01", Message: "terminating connection due to administrator command"}
	h := idHandler{apply: func(id string) error {
		switch phase.Load() {
		case 0:
			if id == "e4" {
				// The first failure fails the screened batch; the second,
				// its retry whole, splits it.
				if booms.Add(1) == 2 {
					phase.Store(1)
				}
				return errors.New("boom")
			}
			return nil
		case 1:
			return away
		}
		return nil
	}}
	r := startRig(t, h, func(c *consumer.Config) {
		c.Workers, c.Prefetch, c.BatchSize = 1, 4, 4
		c.BatchLinger = 300 * time.Millisecond // one batch of the four
		c.StoreHold = storeHold
		c.DeliveryLimit = 5
	})
	for _, id := range []string{"e1", "e2", "e3", "e4"} {
		r.publish(id, "body of "+id)
	}
	require.Eventually(t, func() bool { return r.stats[guard.OutcomeRetry.String()].Load() >= 4 },
		30*time.Second, 10*time.Millisecond, "the held deliveries were not handed back")
	var firstHold, lastBack time.Time
	for _, s := range r.settlements() {
		if s.Outcome != guard.OutcomeRetry || s.Reason != consumer.RequeueStoreUnavailable {
			continue
		}
		if firstHold.IsZero() {
			firstHold = s.at.Add(-storeHold) // the first half held one StoreHold
		}
		lastBack = s.at
	}
	require.False(t, firstHold.IsZero(), "no delivery was held: %v", r.settlements())
	require.Less(t, lastBack.Sub(firstHold), storeHold+storeHold/2,
		"a delivery was held past StoreHold: its batch's halves each held it anew")
	phase.Store(2)
	require.Eventually(t, func() bool { return r.stats[guard.OutcomeProcessed.String()].Load() == 4 },
		30*time.Second, 10*time.Millisecond)
}
