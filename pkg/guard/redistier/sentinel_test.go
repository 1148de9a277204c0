package redistier_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/guard"
)

// TestSentinelFailoverResumesTheFastTier claims through a client built as
// idem consume builds it (redis.mode sentinel), then kills the master:
// claims fail within their deadline until the Sentinel promotes the
// replica, then succeed on it.
func TestSentinelFailoverResumesTheFastTier(t *testing.T) {
	t.Parallel()
	s, err := sandbox.StartRedisSentinel(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(s.Kill)
	f := failoverFilter(t, "sentinel", s.URL())
	ctx := context.Background()
	claim := func(i int) []tier.FastResult {
		return f.Claim(ctx, "svc", "", []guard.Event{{ID: fmt.Sprintf("evt_%d", i), Hash: guard.HashFields("x")}})
	}
	// A Sentinel that just started may not hand out its master at once (a
	// CI run on a loaded machine saw the first claim fail): the client must
	// work before the kill, however long the sandbox took to settle.
	first := 0
	require.Eventually(t, func() bool { first--; return claim(first)[0].State == tier.FastAcquired }, 15*time.Second, 50*time.Millisecond,
		"no claim went through the Sentinel's master before the kill")

	s.Master.Kill()
	took, failed := requireResumes(t, claim)
	addr, err := s.MasterAddr(time.Second)
	require.NoError(t, err)
	require.Equal(t, fmt.Sprintf("127.0.0.1:%d", s.Replica.Port), addr, "the Sentinel promoted the replica")
	t.Logf("resumed %s after the kill, %d claims failed meanwhile", took.Round(time.Millisecond), failed)
}
