package chaos

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/lab"
	"github.com/idemhq/idem/internal/loadgen"
	"github.com/idemhq/idem/internal/testenv"
)

// TestLabShowsEachFailureMode runs `idem-lab lab` small on four approaches and
// checks that the measurement shows what each one is: no dedup doubles
// every re-sent event; a Redis claim before processing loses the event
// whose worker died after the claim, and doubles once Redis forgets; the
// unique constraint and idem never double or lose, in any pass.
//
// Not parallel: it runs worker fleets of its own, with a Redis of its own
// killed under them, for each approach and pass; it takes its turn among
// the chaos runs rather than running beside TestChaosCI.
func TestLabShowsEachFailureMode(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "lab.json")
	const events, seed = 600, 3
	cmd := exec.Command(labBin, "lab", "--events", "600", "--seed", "3", "--outage", "2s",
		"--approaches", "broker-only,redis-claim-first,pg-unique,idem", "--dir", dir, "--json", out)
	cmd.Env = append(os.Environ(), "AMQP_URL="+testenv.AMQPURL(), "DATABASE_URL="+testenv.DatabaseURL())
	b, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", b)
	t.Logf("%s", b)
	require.Contains(t, string(b), "msg/s down")

	var rows []lab.Row
	raw, err := os.ReadFile(out)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(raw, &rows))
	by := map[string]lab.Row{}
	for _, r := range rows {
		by[r.Approach] = r
	}

	// The stream the lab builds: every event sent more than once is
	// doubled by an approach without dedup, in every pass.
	s, err := loadgen.Build(loadgen.StreamSpec{RunID: loadgen.RunID(seed), Count: events, Users: 100,
		DupRatio: 0.25, DelayWindow: 500, Seed: seed})
	require.NoError(t, err)
	resent := 0
	for _, ev := range loadgen.NewManifest(loadgen.StreamSpec{}, "", s).Events {
		if ev.Sends > 1 {
			resent++
		}
	}
	for _, pass := range lab.Passes {
		if pass == lab.PassCrash {
			// A worker killed after its effect, before its ack, doubles
			// its event and any other it had committed.
			require.Greater(t, by["broker-only"].Passes[pass].Doubled, resent, "broker-only, crash pass")
		} else {
			require.Equal(t, resent, by["broker-only"].Passes[pass].Doubled, "broker-only, %s pass", pass)
		}
		for _, a := range []string{"pg-unique", "idem"} {
			p := by[a].Passes[pass]
			require.Zero(t, p.Doubled, "%s doubled in the %s pass", a, pass)
			require.Zero(t, p.Lost, "%s lost events in the %s pass", a, pass)
		}
	}
	claim := by["redis-claim-first"].Passes
	require.Zero(t, claim[lab.PassClean].Doubled, "SET NX decides races")
	require.Contains(t, claim[lab.PassCrash].Crashes, lab.AfterCheck)
	require.Positive(t, claim[lab.PassCrash].Lost, "a worker killed after its claim loses the event")
	require.Positive(t, claim[lab.PassRedis].Doubled, "a Redis that forgot its claims lets re-sends through")
	require.Positive(t, by["idem"].Passes[lab.PassRedis].OutageRate, "idem keeps going while Redis is down")
	require.Greater(t, by["idem"].Passes[lab.PassClean].RedisTrips, 0.0)
	require.Zero(t, by["pg-unique"].Passes[lab.PassClean].RedisTrips)
}
