package consumer_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/redistier"
)

// TestADuplicateRedisKnowsIsAckedOnlyInTheStoresHistory: a stream that Redis
// knows whole as done is acked off the pipeline, once the store confirmed
// the history its markers name; after the store's rows went back to before
// the events (their dedup rows and effects gone, as a restore does, with the
// consumer's connections open and no call failing), the same stream is
// applied again, once, not acked on the markers written before. Batched and
// one event at a time.
func TestADuplicateRedisKnowsIsAckedOnlyInTheStoresHistory(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		tune func(*consumer.Config)
	}{
		{"batched", func(cfg *consumer.Config) { cfg.Prefetch, cfg.BatchSize, cfg.BatchLinger = 64, 16, 5*time.Millisecond }},
		{"per-event", func(cfg *consumer.Config) { cfg.Prefetch, cfg.BatchSize, cfg.Workers = 16, 1, 4 }},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			rdb, prefix := testenv.Redis(t)
			fast, err := redistier.New(rdb, redistier.Config{Prefix: prefix, Timeout: 5 * time.Second}) // a loaded machine opens no breaker here
			require.NoError(t, err)
			r := startRigWith(t, batchHandler{}, fast, c.tune)
			const n = 40
			count := func(o guard.Outcome) int64 { return r.stats[o.String()].Load() }
			total := func() int64 {
				var s int64
				for _, o := range guard.Outcomes() {
					s += count(o)
				}
				return s
			}
			send := func(round int) {
				for i := range n {
					id := fmt.Sprintf("evt_%d", i)
					r.publish(id, id)
				}
				require.Eventually(t, func() bool { return total() == int64(round*n) }, 30*time.Second, 5*time.Millisecond,
					"round %d: settled %d of %d", round, total(), round*n)
			}
			markers := func() int {
				keys, err := rdb.Keys(context.Background(), prefix+":*").Result()
				require.NoError(t, err)
				done := 0
				for _, k := range keys {
					if v, _ := rdb.Get(context.Background(), k).Result(); strings.HasPrefix(v, "done:") {
						done++
					}
				}
				return done
			}
			ledger := func() (rows, distinct int) {
				require.NoError(t, r.pool.QueryRow(context.Background(), `SELECT count(*), count(DISTINCT event_id) FROM ledger`).Scan(&rows, &distinct))
				return rows, distinct
			}

			send(1)
			require.Equal(t, int64(n), count(guard.OutcomeProcessed))
			require.Eventually(t, func() bool { return markers() == n }, 10*time.Second, 5*time.Millisecond, "the done markers were never written")

			send(2)
			require.Equal(t, int64(n), count(guard.OutcomeDuplicateRedis), "Redis knew every event of the second round")

			_, err = r.pool.Exec(context.Background(), `TRUNCATE idem_processed; DELETE FROM ledger`)
			require.NoError(t, err)
			send(3)
			require.Equal(t, int64(2*n), count(guard.OutcomeProcessed), "an event the store lost was acked on a marker of its old history")
			rows, distinct := ledger()
			require.Equal(t, [2]int{n, n}, [2]int{rows, distinct})

			require.Eventually(t, func() bool {
				send(4)
				return count(guard.OutcomeDuplicateRedis) > int64(n)
			}, 30*time.Second, time.Millisecond, "the markers of the new history never counted")
			rows, distinct = ledger()
			require.Equal(t, [2]int{n, n}, [2]int{rows, distinct})
			require.Zero(t, count(guard.OutcomeRetry))
		})
	}
}
