package pgtier_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/horizon"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/guard/pgtier"
)

// TestAPruneIsNotStarvedBySlowClaims: guard transactions that each
// last 1 s (a handler calling a downstream) overlap continuously, as four
// workers under load do. The bounded barrier asks for the exclusive lock
// 100 ms at a time and gives up whenever some holder needs longer, so it
// never meets a 100 ms window in which every holder ends: prune never
// passes. Before 443855a the exclusive request queued new claims and
// passed once the in-flight ones ended (about 1 s).
func TestAPruneIsNotStarvedBySlowClaims(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t, testenv.Effects)
	ctx := context.Background()
	_, err := horizon.Enforce(ctx, pool, time.Hour, time.Minute)
	require.NoError(t, err)

	load, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	const workers, hold = 4, time.Second
	for i := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(i) * hold / workers) // staggered, as workers are
			for load.Err() == nil {
				tx, err := pgtier.New(pool).Begin(load)
				if err != nil {
					continue
				}
				select {
				case <-time.After(hold):
				case <-load.Done():
				}
				_ = tx.Rollback(context.Background())
			}
		}()
	}
	defer func() { stop(); wg.Wait() }()
	time.Sleep(hold)

	pctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	began := time.Now()
	_, _, err = horizon.Prune(pctx, pool, horizon.PruneConfig{Retention: time.Hour, ClockSkew: time.Minute, Batch: 100})
	require.NoError(t, err, "prune never passed its barrier under continuous 1 s claims (waited %s)", time.Since(began).Round(time.Millisecond))
}
