package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
)

// TestAMissingTableStopsTheConsumerNotTheStream is issue 26's acceptance:
// the payments handler's table is renamed away (a migration forgotten in a
// deploy) and 200 events are published to a real `idem consume`. At most a
// handful may be dead-lettered; /readyz must be 503 naming the error, and
// the metric must say the kill switch is open; once the table is back,
// every event must be applied exactly once and nothing lost. Before the
// kill switch the consumer dead-lettered all 200 in seconds while /readyz
// stayed green.
func TestAMissingTableStopsTheConsumerNotTheStream(t *testing.T) {
	t.Parallel()
	missingTableStopsTheConsumer(t, newEnv(t, "", ""))
}

// TestThroughPgBouncerAMissingTableStopsTheConsumer is the same through a
// transaction-mode PgBouncer: the kill switch reads the same SQLSTATE
// through the pooler.
func TestThroughPgBouncerAMissingTableStopsTheConsumer(t *testing.T) {
	t.Parallel()
	e, _ := newPoolerEnv(t, sandbox.PgBouncerOptions{})
	r := e.run([]string{"IDEM_HANDLER=payments"}, "migrate") // through the pooler
	require.Equal(t, 0, r.code, r.out)
	missingTableStopsTheConsumer(t, e)
}

func missingTableStopsTheConsumer(t *testing.T, e *env) {
	const handful = 5
	ctx := context.Background()
	addr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	_, err := e.pool.Exec(ctx, `ALTER TABLE payments_ledger RENAME TO payments_ledger_away`)
	require.NoError(t, err)
	c0 := e.consume("c0", "IDEM_METRICS_ADDR="+addr,
		"IDEM_CONSUMER_KILL_SWITCH_PROBE_MIN=200ms", "IDEM_CONSUMER_KILL_SWITCH_PROBE_MAX=1s")
	e.waitConsuming(c0)
	readyz := func(want int) string {
		t.Helper()
		var text string
		require.Eventually(t, func() bool {
			var code int
			code, text = get(t, "http://"+addr+"/readyz")
			return code == want
		}, 60*time.Second, 20*time.Millisecond, "/readyz never answered %d: %s", want, text)
		return text
	}
	readyz(http.StatusOK)

	m := e.publish(200, 0)
	text := readyz(http.StatusServiceUnavailable)
	require.Contains(t, text, "consumer: failing: kill switch open")
	require.Contains(t, text, "failed with 42P01")
	require.Contains(t, text, `relation "payments_ledger" does not exist`)
	s := scrapeMetrics(t, addr)
	require.Equal(t, 1.0, s.value("idem_kill_switch_open", "class", "42P01"))
	require.Equal(t, 1.0, s.value("idem_kill_switch_trips_total"))
	// Probes come and fail; the consumer stays not ready.
	require.Eventually(t, func() bool {
		b, _ := os.ReadFile(c0.LogPath)
		return strings.Count(string(b), "the probe failed;") >= 2
	}, 60*time.Second, 20*time.Millisecond, "no two probes failed")
	dlq := func() int { return testenv.QueueDepth(t, e.amqpURL, e.queue+".dlq") }
	require.LessOrEqual(t, dlq(), handful, "the stream went to the dead-letter queue")
	readyz(http.StatusServiceUnavailable)

	// The table is back: the next probe is processed, and the consumer
	// resumes by itself.
	_, err = e.pool.Exec(ctx, `ALTER TABLE payments_ledger_away RENAME TO payments_ledger`)
	require.NoError(t, err)
	readyz(http.StatusOK)
	require.Equal(t, 0.0, scrapeMetrics(t, addr).value("idem_kill_switch_open", "class", ""))
	require.True(t, c0.LogContains("kill switch closed"))
	if n := dlq(); n > 0 {
		// A handful may have spent their attempts before the trip: not
		// lost, replayed.
		t.Logf("%d dead-lettered before the trip; replaying them", n)
		out, err := e.idem("dlq", "replay", "--all")
		require.NoError(t, err, out)
	}
	e.waitApplied(m)
	e.stopAll()
	e.requireExactlyOnce(m)
	require.Zero(t, dlq())
}
