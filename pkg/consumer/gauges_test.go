package consumer_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/consumer"
)

// TestTheGaugesCountWhatTheBrokerCounts: with the one worker busy, the
// broker has sent every event (none ready, none acked: all unacked in its
// count), and Stats counts each of them as in flight and unacked, wherever
// it waits in the consumer. Before, only the deliveries a batch had taken
// counted: the rest, received and waiting for room, did not (316 and 770
// in flight against the broker's 1,024 in a gray-failure run).
func TestTheGaugesCountWhatTheBrokerCounts(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	var once sync.Once
	r := startRig(t, handlerFunc{apply: func(ctx context.Context, tx pgx.Tx) error {
		select {
		case <-release:
		case <-ctx.Done():
			return ctx.Err()
		}
		_, err := tx.Exec(ctx, `INSERT INTO ledger (event_id, user_id, amount) VALUES (gen_random_uuid()::text, 'u', 1)`)
		return err
	}}, func(cfg *consumer.Config) {
		cfg.Prefetch, cfg.Workers, cfg.BatchSize = 32, 1, 1
		cfg.HandlerTimeout = time.Minute
	})
	t.Cleanup(func() { once.Do(func() { close(release) }) })

	const n = 20
	for i := range n {
		r.publish(fmt.Sprintf("evt_%d", i), fmt.Sprintf("body_%d", i))
	}
	require.Eventually(t, func() bool { return testenv.QueueDepth(t, testenv.AMQPURL(), r.queue) == 0 }, 20*time.Second, 10*time.Millisecond,
		"the broker sent every event")
	require.Eventually(t, func() bool {
		s := r.consumerStats()
		return s.InFlight == n && s.Unacked == n
	}, 10*time.Second, 10*time.Millisecond, "Stats counts every delivery the broker counts: %+v", r.consumerStats())

	once.Do(func() { close(release) })
	r.requireLedger(n)
	require.Eventually(t, func() bool {
		s := r.consumerStats()
		return s.InFlight == 0 && s.Unacked == 0
	}, 10*time.Second, 10*time.Millisecond, "every delivery acked: %+v", r.consumerStats())
}
