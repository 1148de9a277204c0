package config

import (
	"fmt"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard/redistier"
)

func load(t *testing.T, yaml string, env map[string]string) (Config, error) {
	t.Helper()
	path := ""
	if yaml != "" {
		path = filepath.Join(t.TempDir(), "idem.yaml")
		require.NoError(t, os.WriteFile(path, []byte(yaml), 0o644))
	}
	var environ []string
	for k, v := range env {
		environ = append(environ, k+"="+v)
	}
	return Load(path, environ)
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

// TestMaxBodyBytesReachesTheConsumer: consumer.max_body_bytes defaults to
// 1 MiB and, from the file or the environment, is the consumer's limit.
func TestMaxBodyBytesReachesTheConsumer(t *testing.T) {
	cfg, err := load(t, "", nil)
	require.NoError(t, err)
	require.Equal(t, 1<<20, cfg.Consumer.MaxBodyBytes)
	cfg, err = load(t, "consumer:\n  max_body_bytes: 4096\n", nil)
	require.NoError(t, err)
	require.Equal(t, 4096, cfg.ConsumerConfig().MaxBodyBytes)
	cfg, err = load(t, "consumer:\n  max_body_bytes: 4096\n", map[string]string{"IDEM_CONSUMER_MAX_BODY_BYTES": "65536"})
	require.NoError(t, err)
	require.Equal(t, 65536, cfg.ConsumerConfig().MaxBodyBytes)
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
		// Values that used to be accepted and could not work.
		{"prefetch past 16 bits", "consumer:\n  prefetch: 65536\n", nil, "consumer.prefetch: 65536 is out of range; want 1 to 65535"},
		{"prefetch wrapping to 1", "", map[string]string{"IDEM_CONSUMER_PREFETCH": "65537"}, "consumer.prefetch: 65537 is out of range"},
		{"redis timeout 1ns", "redis:\n  timeout: 1ns\n", nil, "redis.timeout: 1ns is out of range; want 1ms to 10s"},
		{"drain timeout 1ns", "", map[string]string{"IDEM_CONSUMER_DRAIN_TIMEOUT": "1ns"}, "consumer.drain_timeout: 1ns is out of range"},
		{"breaker open for 10000h", "redis:\n  breaker_open_timeout: 10000h\n", nil, "redis.breaker_open_timeout: 10000h0m0s is out of range; want 100ms to 10m0s"},
		{"max body bytes under 1 KiB", "consumer:\n  max_body_bytes: 100\n", nil, "consumer.max_body_bytes: 100 is out of range; want 1024 to 536870912"},
		{"a million workers", "consumer:\n  workers: 1000000\n", nil, "consumer.workers: 1000000 is out of range; want 1 to 1024"},
		{"store hold past the broker's ack timeout", "consumer:\n  store_hold: 1h\n", nil, "consumer.store_hold"},
		{"untimed policy", "consumer:\n  untimed: maybe\n", nil, `consumer.untimed: "maybe" is not a policy; want auto or reject`},
		{"untimed accept, removed", "consumer:\n  untimed: accept\n", nil, `consumer.untimed: accept was removed`},
		// A zero skew was recorded as zero while the consumer enforced 5m.
		{"zero clock skew", "consumer:\n  clock_skew: 0s\n", nil, `consumer.clock_skew: 0s is out of range; want 1s to 1d`},
		{"retention under an hour", "postgres:\n  retention: 1m\n", nil, "postgres.retention"},
		{"huge integer", "", map[string]string{"IDEM_CONSUMER_WORKERS": "99999999999999999999"}, `consumer.workers (from IDEM_CONSUMER_WORKERS): "99999999999999999999" is not a whole number`},
		{"duration as a sentence", "", map[string]string{"IDEM_REDIS_LEASE": "30"}, `redis.lease (from IDEM_REDIS_LEASE): "30" is not a duration; write one such as 250ms`},
		{"bool as a sentence", "", map[string]string{"IDEM_REDIS_ENABLED": "yes please"}, `"yes please" is not a boolean; write true or false`},
		// A misspelt variable is refused like a misspelt key.
		{"misspelt env var", "", map[string]string{"IDEM_CONSUMER_WORKER": "4"}, "IDEM_CONSUMER_WORKER names no setting"},
		{"misspelt nested env var", "", map[string]string{"IDEM_REDIS_DONETTL": "1h"}, "IDEM_REDIS_DONETTL names no setting"},
		// URLs go through their libraries' parsers at start.
		{"http scheme", "", map[string]string{"AMQP_URL": "http://guest:guest@127.0.0.1:5672/"}, "amqp_url: cannot be parsed as an AMQP URL"},
		{"bad amqp port", "", map[string]string{"AMQP_URL": "amqp://guest:guest@127.0.0.1:port/"}, "amqp_url"},
		{"bad redis url", "", map[string]string{"REDIS_URL": "redis://127.0.0.1:6379/notadb"}, "redis_url"},
		{"bad database url", "", map[string]string{"DATABASE_URL": "postgres://a:b@h:notaport/db"}, "database_url"},
		{"unknown redis mode", "", map[string]string{"IDEM_REDIS_MODE": "ring"}, `redis.mode: "ring" is not a mode; want single, cluster or sentinel`},
		{"cluster url with a database", "redis:\n  mode: cluster\n", map[string]string{"REDIS_URL": "redis://h:7001?addr=h:7002&db=3"}, "redis_url: cannot be parsed as a Redis Cluster URL"},
		// The outbox.
		{"unknown handler", "handler: refunds\n", nil, `handler: "refunds" is not a reference handler`},
		{"destination without a target", "", map[string]string{"IDEM_OUTBOX_DESTINATIONS": "receipts="}, "outbox.destinations"},
		{"emit to an unknown destination", "outbox:\n  emit: mailer\n  destinations: receipts=queue:r\n", nil, `outbox.emit: "mailer" is not one of outbox.destinations (receipts)`},
		{"relay with nowhere to send", "outbox:\n  relay: true\n", nil, "outbox.relay: a relay needs outbox.destinations"},
		{"429 as done", "outbox:\n  done_status: 429\n", nil, "outbox.done_status"},
		{"backoff min above max", "outbox:\n  backoff_min: 10m\n", nil, "outbox.backoff_min"},
		{"sentinel without a master", "", map[string]string{"IDEM_REDIS_MODE": "sentinel", "REDIS_URL": "redis://h:26379?addr=h:26380"}, "redis_url: names no master: add master_name="},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := load(t, c.yaml, c.env)
			require.ErrorContains(t, err, c.want)
		})
	}
}

// TestRedisModesBuildTheirClients checks each mode builds its client type
// from go-redis's own URL syntax, with per-call deadlines on.
func TestRedisModesBuildTheirClients(t *testing.T) {
	for _, c := range []struct{ mode, url, want string }{
		{"single", "redis://h:6379/2", "*redis.Client"},
		{"cluster", "redis://h:7001?addr=h:7002&addr=h:7003", "*redis.ClusterClient"},
		{"sentinel", "redis://h:26379?addr=h:26380&master_name=mymaster", "*redis.Client"},
	} {
		cfg, err := load(t, "", map[string]string{"IDEM_REDIS_MODE": c.mode, "REDIS_URL": c.url})
		require.NoError(t, err, c.mode)
		rdb, err := cfg.RedisClient()
		require.NoError(t, err, c.mode)
		require.Equal(t, c.want, fmt.Sprintf("%T", rdb), c.mode)
		_, err = redistier.New(rdb, redistier.Config{})
		require.NoError(t, err, "%s: per-call deadlines must be on", c.mode)
		rdb.Close()
	}
}

func TestStrconvTextNeverReachesTheUser(t *testing.T) {
	for _, env := range []map[string]string{
		{"IDEM_CONSUMER_WORKERS": "many"},
		{"IDEM_CONSUMER_WORKERS": "99999999999999999999"},
		{"IDEM_REDIS_BREAKER_FAILURES": "-1"},
		{"IDEM_REDIS_ENABLED": "maybe"},
	} {
		_, err := load(t, "", env)
		require.Error(t, err)
		require.NotContains(t, err.Error(), "strconv")
		require.NotContains(t, err.Error(), "invalid syntax")
	}
}

func TestTestHooksAreNotUnknownVariables(t *testing.T) {
	_, err := load(t, "", map[string]string{"IDEM_CRASH_AT": "after_commit", "IDEM_CHAOS_SEED": "7", "NOT_IDEM_X": "1"})
	require.NoError(t, err)
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
	cfg, err := Load("../../idem.example.yaml", nil)
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

// TestBatchSizeFollowsAPrefetchBelowIt: an unset batch_size is 256, or the
// prefetch if lower; one set above the prefetch is an error, not clamped.
func TestBatchSizeFollowsAPrefetchBelowIt(t *testing.T) {
	cfg, err := Load("", []string{"IDEM_CONSUMER_PREFETCH=10"})
	require.NoError(t, err)
	require.Equal(t, 10, cfg.Consumer.BatchSize)
	cfg, err = Load("", nil)
	require.NoError(t, err)
	require.Equal(t, 256, cfg.Consumer.BatchSize)
	_, err = Load("", []string{"IDEM_CONSUMER_PREFETCH=10", "IDEM_CONSUMER_BATCH_SIZE=20"})
	require.ErrorContains(t, err, "consumer.batch_size: 20 exceeds consumer.prefetch (10)")
}

// TestDefaultsAreThePackagesOwn: the file's defaults are the library's,
// so that a setting left out runs as a library user's would.
func TestDefaultsAreThePackagesOwn(t *testing.T) {
	d := Default()
	c := d.ConsumerConfig()
	c.URL, c.Queue, c.Partitions = "", "", 0
	require.Equal(t, consumer.Config{}.WithDefaults().Retention, c.Retention)
	lib := consumer.Config{}.WithDefaults()
	lib.ConnectionName, lib.Observer, lib.Logger = "", nil, nil // the command's own
	require.Equal(t, lib, c)
	require.Equal(t, redistier.Config{}.WithDefaults(), d.FastConfig())
}

// TestOutboxHeadersAreReadFromTheEnvironment: outbox.headers names a header
// of an HTTP destination and the variable its value is read from, in the
// file or in IDEM_OUTBOX_HEADERS; RelayConfig hands the values to the
// relay, and only to that destination.
func TestOutboxHeadersAreReadFromTheEnvironment(t *testing.T) {
	const token = "Bearer Zq7sentinelTOKEN"
	env := map[string]string{"MAILER_AUTH": token, "MAILER_KEY": "k-Zq7sentinelKEY"}
	for name, c := range map[string]struct {
		yaml string
		env  map[string]string
	}{
		"file": {"outbox:\n  destinations: mailer=https://mail.example/send receipts=queue:r\n  headers: |\n    mailer:Authorization=env:MAILER_AUTH\n    mailer:x-api-key=env:MAILER_KEY\n", env},
		"env": {"", map[string]string{
			"IDEM_OUTBOX_DESTINATIONS": "mailer=https://mail.example/send receipts=queue:r",
			"IDEM_OUTBOX_HEADERS":      "mailer:Authorization=env:MAILER_AUTH mailer:x-api-key=env:MAILER_KEY",
			"MAILER_AUTH":              token, "MAILER_KEY": "k-Zq7sentinelKEY",
		}},
	} {
		t.Run(name, func(t *testing.T) {
			cfg, err := load(t, c.yaml, c.env)
			require.NoError(t, err)
			dests := cfg.RelayConfig().Destinations
			require.Equal(t, http.Header{"Authorization": {token}, "X-Api-Key": {"k-Zq7sentinelKEY"}}, dests["mailer"].Header)
			require.Nil(t, dests["receipts"].Header)
			for _, f := range FieldsOf(cfg) {
				require.NotContains(t, f.Default, "Zq7sentinel", f.Path)
			}
		})
	}
	cfg, err := load(t, "", nil)
	require.NoError(t, err)
	require.Nil(t, cfg.Outbox.header, "no headers by default")
}

// TestOutboxFinalStatusesPerDestination: outbox.final_statuses sets which
// answers are final for the destinations it names; the others keep the
// default (nil); a bad entry is refused naming it.
func TestOutboxFinalStatusesPerDestination(t *testing.T) {
	env := map[string]string{
		"IDEM_OUTBOX_DESTINATIONS":   "mailer=https://mail.example/send hook=https://h.example/ receipts=queue:r",
		"IDEM_OUTBOX_FINAL_STATUSES": "mailer=400,409-410 hook=none",
	}
	cfg, err := load(t, "", env)
	require.NoError(t, err)
	dests := cfg.RelayConfig().Destinations
	require.Equal(t, []int{400, 409, 410}, dests["mailer"].Final)
	require.Equal(t, []int{}, dests["hook"].Final)
	require.Nil(t, dests["receipts"].Final)
	for final, want := range map[string]string{
		"sms=400":         `outbox.final_statuses: "sms" is not one of outbox.destinations`,
		"receipts=400":    `outbox.final_statuses: "receipts" is queue:r/1, not an http(s) URL`,
		"mailer=4xx":      `outbox.final_statuses: mailer: "4xx": want a status or a range of them, 300 to 599`,
		"mailer":          `outbox.final_statuses: "mailer": want <destination>=<statuses>`,
		"hook=400 hook=1": `outbox.final_statuses: "hook": destination named twice`,
	} {
		env["IDEM_OUTBOX_FINAL_STATUSES"] = final
		_, err := load(t, "", env)
		require.ErrorContains(t, err, want, final)
	}
}

// TestOutboxHeadersErrors: a bad outbox.headers is refused at start, naming
// the entry (destination:header) and the variable, never a value.
func TestOutboxHeadersErrors(t *testing.T) {
	const secret = "Zq7sentinelTOKEN"
	dests := "mailer=https://mail.example/send receipts=queue:r"
	for _, c := range []struct {
		name, headers string
		env           map[string]string
		want          string
	}{
		{"unset variable", "mailer:Authorization=env:MAILER_AUTH", nil,
			"outbox.headers: mailer:Authorization: the environment variable MAILER_AUTH is unset or empty"},
		{"empty variable", "mailer:Authorization=env:MAILER_AUTH", map[string]string{"MAILER_AUTH": ""},
			"the environment variable MAILER_AUTH is unset or empty"},
		{"literal value", "mailer:Authorization=" + secret, nil,
			"outbox.headers: mailer:Authorization: a value must come from the environment: write mailer:Authorization=env:<VARIABLE>"},
		{"literal bearer token", "mailer:Authorization=Bearer " + secret, nil, "a literal value is refused"},
		{"unknown destination", "sms:Authorization=env:SMS_AUTH", map[string]string{"SMS_AUTH": secret},
			`outbox.headers: sms:Authorization: "sms" is not one of outbox.destinations (mailer, receipts)`},
		{"queue destination", "receipts:Authorization=env:R_AUTH", map[string]string{"R_AUTH": secret},
			`outbox.headers: receipts:Authorization: "receipts" is queue:r/1, not an http(s) URL`},
		{"bad header name", "mailer:X(Key)=env:KEY", map[string]string{"KEY": secret},
			`outbox.headers: mailer:X(Key): "X(Key)" is not a header name`},
		{"idem's own header", "mailer:idempotency-key=env:KEY", map[string]string{"KEY": secret},
			"mailer:idempotency-key: idem or HTTP sets this header itself"},
		{"header twice", "mailer:X-Key=env:A mailer:x-key=env:B", map[string]string{"A": secret, "B": secret},
			"mailer:x-key: header given twice"},
		{"no destination", ":X-Key=env:KEY", map[string]string{"KEY": secret}, `outbox.headers: ":X-Key": want <destination>:<Header-Name>=env:<VARIABLE>`},
		{"no value", "mailer:X-Key " + secret, nil, "outbox.headers: entry 1: want <destination>:<Header-Name>=env:<VARIABLE>"},
		{"bad variable name", "mailer:X-Key=env:" + secret + "-1", nil, "mailer:X-Key: env: must be followed by a variable's name"},
		{"idem variable", "mailer:X-Key=env:IDEM_KEY", nil, "IDEM_* variables are idem's settings"},
		{"line break in the value", "mailer:X-Key=env:KEY", map[string]string{"KEY": secret + "\r\nX-Evil: 1"},
			"outbox.headers: mailer:X-Key: the value of KEY holds a line break or another control character"},
	} {
		t.Run(c.name, func(t *testing.T) {
			env := map[string]string{"IDEM_OUTBOX_DESTINATIONS": dests, "IDEM_OUTBOX_HEADERS": c.headers}
			maps.Copy(env, c.env)
			_, err := load(t, "", env)
			require.ErrorContains(t, err, c.want)
			require.NotContains(t, err.Error(), secret)
		})
	}
	_, err := load(t, "outbox:\n  headers: mailer:Authorization=env:MAILER_AUTH\n", map[string]string{"MAILER_AUTH": secret})
	require.ErrorContains(t, err, `"mailer" is not one of outbox.destinations (empty)`)
}
