package redistier_test

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/guard/redistier"
)

// TestBreakerTransitionsOnAFakeClock walks the breaker through
// closed → open → half-open → open → half-open → closed. gobreaker reads
// time.Now, so the test runs in a synctest bubble, whose clock only moves
// when the test sleeps: the 30 s open timeout passes instantly and exactly.
// Failures open it only once they have gone on for MinOutage: a burst of
// them, as a busy machine makes, does not.
func TestBreakerTransitionsOnAFakeClock(t *testing.T) {
	m := miniredis.RunT(t) // outside the bubble: its goroutines are real
	synctest.Test(t, func(t *testing.T) {
		rdb := redis.NewClient(&redis.Options{Addr: m.Addr(), ContextTimeoutEnabled: true, MaxRetries: -1, PoolSize: 1})
		defer rdb.Close()
		var transitions []string
		f, err := redistier.New(rdb, redistier.Config{Breaker: redistier.BreakerConfig{
			FailureThreshold: 2,
			MinOutage:        time.Second,
			OpenTimeout:      30 * time.Second,
			OnStateChange:    func(from, to string) { transitions = append(transitions, from+"->"+to) },
		}})
		require.NoError(t, err)
		ctx := context.Background()

		m.SetError("ERR injected")
		claim(f, ctx)
		require.Equal(t, "closed", f.BreakerState(), "one failure is below the threshold")
		for range 5 {
			claim(f, ctx)
		}
		require.Equal(t, "closed", f.BreakerState(), "a burst of failures shorter than MinOutage")
		m.SetError("")
		claim(f, ctx) // a success ends the run of failures
		m.FlushAll()  // and leaves a lease the last probe must not see
		m.SetError("ERR injected")
		claim(f, ctx)
		time.Sleep(200 * time.Millisecond)
		claim(f, ctx)
		require.Equal(t, "closed", f.BreakerState(), "failing for 200ms since the success, not a second")
		time.Sleep(800 * time.Millisecond)
		claim(f, ctx)
		require.Equal(t, "open", f.BreakerState(), "failing for a second")

		time.Sleep(30 * time.Second)
		require.Equal(t, "open", f.BreakerState(), "still open at the timeout itself")
		time.Sleep(time.Millisecond)
		require.Equal(t, "half-open", f.BreakerState())

		// A failed probe opens it again for a full timeout.
		require.Equal(t, tier.FastSkipped, claim(f, ctx).State)
		require.Equal(t, "open", f.BreakerState())
		time.Sleep(30*time.Second + time.Millisecond)
		require.Equal(t, "half-open", f.BreakerState())

		// A good probe closes it.
		m.SetError("")
		require.Equal(t, tier.FastAcquired, claim(f, ctx).State)
		require.Equal(t, "closed", f.BreakerState())
		require.Equal(t, []string{"closed->open", "open->half-open", "half-open->open", "open->half-open", "half-open->closed"}, transitions)
	})
}
