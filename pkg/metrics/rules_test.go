package metrics_test

import (
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/metrics"
)

// rulesDir holds the alerts shipped for Prometheus.
const rulesDir = "../../deploy/prometheus/rules"

// TestEverySeriesTheAlertsReadExistsFromStart: an alert on increase() misses
// the first event of a series that is born at 1. Every metric the shipped
// alerts read must exist as a fresh consumer starts, the conflict and
// dead-letter series at 0.
func TestEverySeriesTheAlertsReadExistsFromStart(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	require.NoError(t, err)
	require.NoError(t, m.WatchConsumer(func() consumer.Stats { return consumer.Stats{} }))
	_, err = relay.NewMetrics(reg, []string{"receipts"}) // idem relay's, and idem consume's with outbox.relay
	require.NoError(t, err)
	families, err := reg.Gather()
	require.NoError(t, err)
	exported := map[string]bool{}
	for _, f := range families {
		exported[f.GetName()] = true
	}

	b, err := os.ReadFile(rulesDir + "/idem.yml")
	require.NoError(t, err)
	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert, Expr string
			}
		}
	}
	require.NoError(t, yaml.Unmarshal(b, &rules))
	names := regexp.MustCompile(`idem_[a-z_]+`)
	alerts := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			alerts++
			for _, name := range names.FindAllString(r.Expr, -1) {
				name = strings.TrimSuffix(name, "_bucket")
				require.True(t, exported[name], "alert %s reads %s, which a fresh consumer does not export", r.Alert, name)
			}
		}
	}
	require.GreaterOrEqual(t, alerts, 8)

	require.Equal(t, 0.0, value(t, reg, "idem_deliveries_total", map[string]string{"outcome": "payload_conflict", "reason": "payload_conflict"}))
	for _, r := range wire.Reasons() {
		require.Equal(t, 0.0, value(t, reg, "idem_dead_letters_total", map[string]string{"reason": r}), r)
	}
	m.AddReasons("invalid_json")
	require.Equal(t, 0.0, value(t, reg, "idem_dead_letters_total", map[string]string{"reason": "invalid_json"}))
}

// TestAlertRules runs the alerts' unit tests with promtool (Debian's
// prometheus package; .ci/services.sh installs it). Without promtool the
// test is skipped, except in CI.
func TestAlertRules(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("promtool is not installed (.ci/services.sh installs it)")
		}
		t.Skip("promtool is not installed (apt-get install prometheus)")
	}
	for _, args := range [][]string{{"check", "rules", "idem.yml"}, {"test", "rules", "idem_test.yml"}} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = rulesDir
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "promtool %s:\n%s", strings.Join(args, " "), out)
	}
}
