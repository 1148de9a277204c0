package config

import (
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func load(t *testing.T, yaml string, env map[string]string) (Config, error) {
	t.Helper()
	path := ""
	if yaml != "" {
		path = filepath.Join(t.TempDir(), "idem.yaml")
		require.NoError(t, os.WriteFile(path, []byte(yaml), 0o644))
	}
	return Load(path, func(k string) string { return env[k] }, slog.New(slog.DiscardHandler))
}

func TestDefaultsAreValid(t *testing.T) {
	cfg, err := load(t, "", nil)
	require.NoError(t, err)
	require.Equal(t, DefaultQueue, cfg.Queue)
	require.Equal(t, int32(cfg.Consumer.Workers+4), cfg.Postgres.MaxConns)
}

func TestYAMLThenEnvOverride(t *testing.T) {
	cfg, err := load(t, "queue: orders\nredis:\n  lease: 45s\n  done_ttl: 2h\nconsumer:\n  workers: 4\n",
		map[string]string{"IDEM_REDIS_DONE_TTL": "3h", "AMQP_URL": "amqp://x@y/", "IDEM_QUEUE": "orders.v2", "IDEM_REDIS_ENABLED": "false"})
	require.NoError(t, err)
	require.Equal(t, "orders.v2", cfg.Queue)
	require.Equal(t, 45*time.Second, cfg.Redis.Lease)
	require.Equal(t, 3*time.Hour, cfg.Redis.DoneTTL)
	require.Equal(t, 4, cfg.Consumer.Workers)
	require.Equal(t, "amqp://x@y/", cfg.AMQPURL)
	require.False(t, cfg.Redis.Enabled)
}

func TestErrorsNameTheField(t *testing.T) {
	cases := []struct {
		name, yaml string
		env        map[string]string
		want       string
	}{
		{"unknown key", "redis:\n  leese: 1s\n", nil, "leese"},
		{"bad duration", "redis:\n  lease: soon\n", nil, "lease"},
		{"bad env", "", map[string]string{"IDEM_CONSUMER_WORKERS": "many"}, "consumer.workers"},
		{"zero workers", "consumer:\n  workers: 0\n", nil, "consumer.workers"},
		{"done ttl past retention", "redis:\n  done_ttl: 48h\npostgres:\n  retention: 24h\n", nil, "redis.done_ttl"},
		{"broker limit below delivery limit", "consumer:\n  delivery_limit: 30\n", nil, "consumer.broker_delivery_limit"},
		{"scope with colon", "scope: a:b\n", nil, "scope"},
		{"prefix with colon", "redis:\n  prefix: a:b\n", nil, "redis.prefix"},
		{"redis timeout not below handler timeout", "redis:\n  timeout: 20s\n", nil, "redis.timeout"},
		{"log level", "log_level: loud\n", nil, "log_level"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := load(t, c.yaml, c.env)
			require.ErrorContains(t, err, c.want)
		})
	}
}

func TestWarnsOnLeaseShorterThanHandlerTimeout(t *testing.T) {
	cfg, err := load(t, "redis:\n  lease: 2s\n", nil)
	require.NoError(t, err)
	require.NotEmpty(t, cfg.Warnings())
	require.Contains(t, cfg.Warnings()[0], "redis.lease")
}

func TestEveryFieldHasAnEnvVar(t *testing.T) {
	seen := map[string]bool{}
	for _, f := range Fields() {
		require.NotEmpty(t, f.Env, f.Path)
		require.False(t, seen[f.Env], "duplicate env %s", f.Env)
		seen[f.Env] = true
	}
	require.True(t, seen["IDEM_QUEUE"])
	require.True(t, seen["DATABASE_URL"])
}

// The example file documents every setting with its default: keep it true.
func TestExampleFileMatchesDefaults(t *testing.T) {
	cfg, err := Load("../../idem.example.yaml", func(string) string { return "" }, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	want := Default()
	want.Postgres.MaxConns = int32(want.Consumer.Workers + 4)
	require.Equal(t, want, cfg)
}

// The README's configuration reference lists every setting and its env var.
func TestReadmeListsEverySetting(t *testing.T) {
	b, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	for _, f := range Fields() {
		require.Contains(t, string(b), "`"+f.Path+"`", "README misses setting %s", f.Path)
		require.Contains(t, string(b), f.Env, "README misses env var %s", f.Env)
	}
}
