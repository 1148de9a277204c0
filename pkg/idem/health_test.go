package idem

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
)

// idleHandler is a handler for a service that is never run.
type idleHandler struct{}

func (idleHandler) Decode(consumer.Message) (guard.Event, string, error) {
	return guard.Event{}, "", nil
}

func (idleHandler) Apply(context.Context, pgx.Tx, string) error { return nil }

// pingCounter counts the PINGs sent through a Redis client: one per run
// of the readiness checks.
type pingCounter struct{ n atomic.Int64 }

func (p *pingCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (p *pingCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "ping" {
			p.n.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (p *pingCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func TestReadyzRunsItsChecksOncePerSecondUnderAProbeStorm(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t)
	mr := miniredis.RunT(t)
	svc, err := New(Config{
		Scope:     "greeter",
		Databases: []*pgxpool.Pool{pool},
		RedisURL:  "redis://" + mr.Addr(),
		Consumer:  consumer.Config{URL: testenv.AMQPURL(), Queue: testenv.Queue(t, testenv.AMQPURL())},
		Logger:    testenv.Logger(t),
	}, idleHandler{})
	require.NoError(t, err)
	t.Cleanup(svc.close)
	var pings pingCounter
	svc.rdb.AddHook(&pings)

	var mu sync.Mutex
	now := time.Unix(1_000_000, 0)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	h := svc.health(clock)
	readyz := func() *httptest.ResponseRecorder {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
		return rec
	}

	var wg sync.WaitGroup
	codes := make([]int, 200)
	for i := range codes {
		wg.Go(func() { codes[i] = readyz().Code })
	}
	wg.Wait()
	for _, c := range codes {
		require.Equal(t, http.StatusServiceUnavailable, c, "not running: the consumer does not consume")
	}
	require.LessOrEqual(t, pings.n.Load(), int64(2), "200 probes within a second share one run of the checks")
	require.GreaterOrEqual(t, pings.n.Load(), int64(1))

	before := pings.n.Load()
	mu.Lock()
	now = now.Add(500 * time.Millisecond)
	mu.Unlock()
	rec := readyz()
	require.Equal(t, before, pings.n.Load(), "a result younger than a second is served as is")
	require.Contains(t, rec.Body.String(), "redis: ok")

	mu.Lock()
	now = now.Add(time.Second)
	mu.Unlock()
	readyz()
	require.Equal(t, before+1, pings.n.Load(), "a result a second old is refreshed")
}
