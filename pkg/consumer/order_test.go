package consumer_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
)

// keyedHandler keys each event by the part of its message ID before the
// colon ("k:1" is key k) and writes a row per event, numbered in the order
// it applies them (only committed rows stay). The slow event takes its
// time, and the fail-once event fails its first attempt.
type keyedHandler struct {
	slow   string
	failed atomic.Bool
}

func (h *keyedHandler) Decode(m consumer.Message) (guard.Event, string, error) {
	key, _, _ := strings.Cut(m.ID, ":")
	return guard.Event{ID: m.ID, Hash: guard.HashFields(string(m.Body)), ShardKey: key}, m.ID, nil
}

func (h *keyedHandler) Apply(ctx context.Context, tx pgx.Tx, id string) error {
	if id == h.slow {
		select {
		case <-time.After(300 * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if strings.HasSuffix(id, "fail-once") && !h.failed.Swap(true) {
		return errors.New("fails once")
	}
	_, err := tx.Exec(ctx, `INSERT INTO applied (id) VALUES ($1)`, id)
	return err
}

// committed returns the events applied, in the order they were applied.
func (r *rig) committed() []string {
	r.t.Helper()
	rows, err := r.pool.Query(context.Background(), `SELECT id FROM applied ORDER BY n`)
	require.NoError(r.t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(r.t, err)
	return ids
}

// TestKeyOrderKeepsOneKeysEventsInDeliveryOrder: with two workers, a later
// batch of a key could commit before an earlier one (here the first batch is
// slow); with KeyOrder it waits. A failing event is retried in place, so
// the events after it do not pass it; other keys are not held up.
func TestKeyOrderKeepsOneKeysEventsInDeliveryOrder(t *testing.T) {
	t.Parallel()
	h := &keyedHandler{slow: "k:1"}
	r := startRig(t, consumer.Handler[string](h), func(c *consumer.Config) {
		c.KeyOrder = true
		c.Workers, c.Prefetch, c.BatchSize = 2, 8, 2
		c.DeliveryLimit = 3
	})
	_, err := r.pool.Exec(context.Background(), `CREATE TABLE applied (id text NOT NULL, n bigserial)`)
	require.NoError(t, err)
	for _, id := range []string{"k:1", "k:2", "k:3", "k:4-fail-once", "k:5", "k:6"} {
		r.publish(id, "body of "+id)
	}
	require.Eventually(t, func() bool { return r.stats[guard.OutcomeProcessed.String()].Load() == 6 }, 30*time.Second, 10*time.Millisecond)
	require.Equal(t, []string{"k:1", "k:2", "k:3", "k:4-fail-once", "k:5", "k:6"}, r.committed())
	require.Zero(t, r.stats[guard.OutcomeRetry.String()].Load(), "a failing event was handed back to the queue")
}
