package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
)

// TestJSONLogsAreJSON: in JSON mode every line a command writes is one JSON
// object: the client libraries' own lines (a failed Redis dial), a
// command's failure, and the config's warnings, each logged once;
// durations read as durations. idem config prints the warnings consume
// logs.
func TestJSONLogsAreJSON(t *testing.T) {
	t.Parallel()
	// A Redis nobody listens on: go-redis logs its failed dials.
	closed := fmt.Sprintf("redis://127.0.0.1:%d/0", testenv.FreePort(t))
	e := newEnv(t, closed, "")
	e.vars = append(e.vars, "IDEM_LOG_FORMAT=json", "IDEM_REDIS_LEASE=1s") // the lease warning
	const warning = "redis.lease (1s) is shorter than consumer.handler_timeout"

	c := e.consume("c0")
	e.waitLog(`"msg":"consuming"`)
	e.waitLog(`"component":"go-redis"`)
	e.stopAll()
	b, err := os.ReadFile(c.LogPath)
	require.NoError(t, err)
	lines := jsonLines(t, string(b))
	warnings := 0
	for _, rec := range lines {
		if strings.Contains(rec["msg"].(string), warning) {
			warnings++
		}
		if rec["msg"] == "consuming" {
			require.Equal(t, "5ms", rec["batch_linger"], "a duration as a duration")
		}
	}
	require.Equal(t, 1, warnings, "the config warning, once")

	// A command that fails ends in a JSON line, not plain text.
	r := e.run([]string{"IDEM_POSTGRES_RETENTION=2h", "IDEM_REDIS_DONE_TTL=1h"}, "prune") // below what the consumer recorded
	require.Equal(t, 1, r.code, r.out)
	last := jsonLines(t, r.out)
	require.Contains(t, last[len(last)-1]["err"], "consumers enforce 720h")
	// So does a bad setting, once the format is known.
	r = e.run([]string{"IDEM_POSTGRES_RETENTION=1h"}, "prune")
	require.Equal(t, 1, r.code, r.out)
	last = jsonLines(t, r.out)
	require.Contains(t, last[len(last)-1]["err"], "redis.done_ttl")

	// idem config shows the warning consume logged.
	out, err := e.idem("config")
	require.NoError(t, err, out)
	require.Contains(t, out, "warning: "+warning)
	require.Equal(t, 1, strings.Count(out, warning))
}

// jsonLines parses every line of out as a JSON object.
func jsonLines(t *testing.T, out string) []map[string]any {
	t.Helper()
	var recs []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &rec), "not JSON: %q", line)
		recs = append(recs, rec)
	}
	return recs
}
