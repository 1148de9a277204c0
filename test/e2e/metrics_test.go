package e2e

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
)

// TestMetricsEndpointCountsOutcomes scrapes a consumer's /metrics while it
// works: the counters an operator alerts on must move.
func TestMetricsEndpointCountsOutcomes(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	addr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	e.consume("c0", "IDEM_METRICS_ADDR="+addr)
	m := e.publish(100, 0.5)
	e.waitApplied(m)

	want := `idem_deliveries_total{outcome="processed",reason=""} 100`
	var body string
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		body = string(b)
		return strings.Contains(body, want)
	}, 30*time.Second, 20*time.Millisecond, "/metrics never showed %s", want)
	require.Contains(t, body, "idem_breaker_open 0")
	e.stopAll()
}
