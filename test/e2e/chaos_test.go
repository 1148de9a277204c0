package e2e

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/chaos"
	"github.com/idemhq/idem/internal/crashpoint"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/consumer"
)

// TestChaosCI runs `idem chaos` with the CI scenario: 4 consumers, 40
// seconds of stream with a quarter re-sent, and every fault kind at least
// once, each crash point included. The command's own verdict must pass,
// and its JSON must show that every fault really happened.
//
// IDEM_CHAOS_SEED replays a seed; the seed in use is logged.
func TestChaosCI(t *testing.T) {
	t.Parallel()
	seed := time.Now().UnixNano() % 1e9
	if s, err := strconv.ParseInt(os.Getenv("IDEM_CHAOS_SEED"), 10, 64); err == nil {
		seed = s
	}
	t.Logf("seed %d (rerun with IDEM_CHAOS_SEED=%d)", seed, seed)
	dir := t.TempDir()
	cmd := exec.Command(idemBin, "chaos", "--duration", "40s", "--rate", "200", "--consumers", "4",
		"--settle", "2m", "--seed", strconv.FormatInt(seed, 10), "--dir", dir)
	cmd.Env = append(os.Environ(), "AMQP_URL="+testenv.AMQPURL())
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "idem chaos failed:\n%s", out)
	require.Contains(t, string(out), "PASS: every event applied exactly once")

	b, err := os.ReadFile(filepath.Join(dir, "chaos.json"))
	require.NoError(t, err)
	var res chaos.Result
	require.NoError(t, json.Unmarshal(b, &res))
	require.True(t, res.OK, res.Problems)
	require.Equal(t, res.Distinct, res.Verify.ExactlyOnce)
	require.Greater(t, res.Published, res.Distinct, "the stream must carry re-sends")
	counts := res.FaultCounts()
	for _, k := range chaos.Kinds {
		require.Positive(t, counts[k], "fault %s never injected", k)
	}
	died := map[string]bool{}
	for _, c := range res.Crashes {
		died[c.Step] = true
	}
	for _, s := range crashpoint.Steps {
		require.True(t, died[string(s)], "no consumer died at crash point %s", s)
	}
	require.Positive(t, res.Breaker["closed->open"], "the Redis faults must have opened a breaker")
	require.Positive(t, res.Outcomes["duplicate_postgres"], "Postgres must have caught duplicates")
	require.Positive(t, res.Outcomes["count/"+consumer.CounterReconnect], "closed broker connections must show as reconnects")
	require.NotEmpty(t, res.Timeline)
	html, err := os.ReadFile(filepath.Join(dir, "chaos.html"))
	require.NoError(t, err)
	require.Contains(t, string(html), "<svg")
}
