package config

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/pkg/consumer"
)

// TestKillSwitchSettingsReachTheConsumer: the consumer.kill_switch* keys,
// from the file or the environment, become consumer.KillSwitch; false turns
// it off; a bad value is refused, naming its key.
func TestKillSwitchSettingsReachTheConsumer(t *testing.T) {
	cfg, err := load(t, "consumer:\n  kill_switch_threshold: 8\n  kill_switch_rate: 0.25\n  kill_switch_window: 30s\n", map[string]string{
		"IDEM_CONSUMER_KILL_SWITCH_PROBE_MIN": "200ms", "IDEM_CONSUMER_KILL_SWITCH_PROBE_MAX": "1s",
	})
	require.NoError(t, err)
	require.Equal(t, consumer.KillSwitch{Threshold: 8, Rate: 0.25, Window: 30 * time.Second,
		Probe: consumer.Backoff{Min: 200 * time.Millisecond, Max: time.Second}}, cfg.ConsumerConfig().KillSwitch)

	cfg, err = load(t, "", map[string]string{"IDEM_CONSUMER_KILL_SWITCH": "false", "IDEM_CONSUMER_KILL_SWITCH_RATE": "7"})
	require.NoError(t, err, "an unused switch's settings are not checked")
	require.True(t, cfg.ConsumerConfig().KillSwitch.Off)

	for env, want := range map[string]string{
		"IDEM_CONSUMER_KILL_SWITCH_RATE=0":           "consumer.kill_switch_rate: 0 is out of range",
		"IDEM_CONSUMER_KILL_SWITCH_RATE=half":        `consumer.kill_switch_rate (from IDEM_CONSUMER_KILL_SWITCH_RATE): "half" is not a number`,
		"IDEM_CONSUMER_KILL_SWITCH_THRESHOLD=0":      "consumer.kill_switch_threshold: 0 is out of range",
		"IDEM_CONSUMER_KILL_SWITCH_WINDOW=10ms":      "consumer.kill_switch_window: 10ms is out of range",
		"IDEM_CONSUMER_KILL_SWITCH_PROBE_MAX=1ms":    "consumer.kill_switch_probe_max: 1ms is out of range",
		"IDEM_CONSUMER_KILL_SWITCH_PROBE_MIN=100h":   "consumer.kill_switch_probe_min: 100h0m0s is out of range",
		"IDEM_CONSUMER_KILL_SWITCH=sometimes":        `consumer.kill_switch (from IDEM_CONSUMER_KILL_SWITCH): "sometimes" is not a boolean`,
		"IDEM_CONSUMER_KILL_SWITCH_RATE=NaN":         "is not a number",
		"IDEM_CONSUMER_KILL_SWITCH_THRESHOLD=100001": "consumer.kill_switch_threshold: 100001 is out of range",
	} {
		_, err := Load("", []string{env})
		require.ErrorContains(t, err, want, env)
	}
}
