package redistier_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/config"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/redistier"
)

// TestSentinelFailoverResumesTheFastTier runs the fast-path suite through a
// client built as idem consume builds it (redis.mode sentinel), then kills
// the master: claims fail within their deadline until the Sentinel promotes
// the replica, then succeed on it.
func TestSentinelFailoverResumesTheFastTier(t *testing.T) {
	t.Parallel()
	s, err := sandbox.StartRedisSentinel(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(s.Kill)
	cfg := config.Default()
	cfg.Redis.Mode, cfg.RedisURL = "sentinel", s.URL()
	rdb, err := cfg.RedisClient()
	require.NoError(t, err)
	t.Cleanup(func() { rdb.Close() })
	const timeout = 50 * time.Millisecond
	f, err := redistier.New(rdb, redistier.Config{Prefix: "sen", Timeout: timeout, Breaker: redistier.BreakerConfig{FailureThreshold: 1 << 30}})
	require.NoError(t, err)
	ctx := context.Background()
	claim := func(i int) []guard.FastResult {
		return f.Claim(ctx, "svc", []guard.Event{{ID: fmt.Sprintf("evt_%d", i), Hash: guard.HashFields("x")}})
	}
	require.Equal(t, guard.FastAcquired, claim(-1)[0].State)

	s.Master.Kill()
	took, failed := requireResumes(t, timeout, claim)
	addr, err := s.MasterAddr(time.Second)
	require.NoError(t, err)
	require.Equal(t, fmt.Sprintf("127.0.0.1:%d", s.Replica.Port), addr, "the Sentinel promoted the replica")
	t.Logf("resumed %s after the kill, %d claims failed meanwhile", took.Round(time.Millisecond), failed)
}
