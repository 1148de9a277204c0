package idem_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard/redistier"
	"github.com/idemhq/idem/pkg/idem"
	"github.com/idemhq/idem/pkg/outbox"
)

// TestAnUnsafeConfigIsAnErrorFromNew: every combination that would open a
// hole, or leave the service without what it needs, stops New with an
// error naming the field; the required fields alone are enough.
func TestAnUnsafeConfigIsAnErrorFromNew(t *testing.T) {
	base := func() idem.Config {
		return idem.Config{
			Scope:       "svc",
			DatabaseURL: "postgres://postgres@127.0.0.1:5432/test",
			Consumer:    consumer.Config{URL: "amqp://guest:guest@127.0.0.1:5672/", Queue: "svc.events"},
		}
	}
	noDeadline := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	t.Cleanup(func() { noDeadline.Close() })
	cases := []struct {
		name string
		tune func(*idem.Config)
		want string
	}{
		{"no database", func(c *idem.Config) { c.DatabaseURL = "" }, "DatabaseURL or Databases is required"},
		{"no scope", func(c *idem.Config) { c.Scope = "" }, "Scope"},
		{"a scope with a colon", func(c *idem.Config) { c.Scope = "a:b" }, "Scope"},
		{"no queue", func(c *idem.Config) { c.Consumer.Queue = "" }, "Queue is required"},
		{"a skew under a second", func(c *idem.Config) { c.Consumer.ClockSkew = time.Millisecond }, "ClockSkew"},
		{"a retention inside the skew", func(c *idem.Config) { c.Consumer.Retention = time.Minute }, "must exceed Consumer.ClockSkew"},
		{"done markers outliving the rows", func(c *idem.Config) {
			c.RedisURL = "redis://127.0.0.1:6379/0"
			c.Fast = redistier.Config{DoneTTL: 40 * 24 * time.Hour}
		}, "Fast.DoneTTL"},
		{"a Redis timeout not below the handler's", func(c *idem.Config) {
			c.RedisURL = "redis://127.0.0.1:6379/0"
			c.Fast = redistier.Config{Timeout: 10 * time.Second}
		}, "Fast.Timeout"},
		{"a Redis client the deadline cannot bound", func(c *idem.Config) { c.Redis = noDeadline }, "ContextTimeoutEnabled"},
		{"two Redis settings", func(c *idem.Config) {
			c.Redis, c.RedisURL = noDeadline, "redis://127.0.0.1:6379/0"
		}, "not both"},
		{"a batch above the prefetch", func(c *idem.Config) { c.Consumer.Prefetch, c.Consumer.BatchSize = 10, 20 }, "BatchSize (20) must not exceed Prefetch (10)"},
		{"pruning too often", func(c *idem.Config) { c.PruneInterval = time.Millisecond }, "PruneInterval"},
		{"the relay on other databases", func(c *idem.Config) {
			c.Outbox = outbox.RelayConfig{Databases: []*pgxpool.Pool{nil},
				Destinations: map[string]outbox.Destination{"api": {URL: "https://api.example.com"}}}
		}, "Outbox.Databases: leave it empty"},
		{"a destination of two kinds", func(c *idem.Config) {
			c.Outbox.Destinations = map[string]outbox.Destination{"api": {URL: "https://api.example.com", Queue: "q"}}
		}, `idem: Outbox: outbox: destination "api": set exactly one of Queue, Exchange and URL`},
		{"a destination of two kinds, relayed elsewhere", func(c *idem.Config) {
			c.Outbox.Destinations = map[string]outbox.Destination{"api": {URL: "https://api.example.com", Queue: "q"}}
			c.NoRelay = true
		}, `destination "api": set exactly one`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cfg := base()
			c.tune(&cfg)
			_, err := idem.New(cfg, greeting{})
			require.ErrorContains(t, err, c.want)
		})
	}
	_, err := idem.New(base(), greeting{})
	require.NoError(t, err, "the required fields are enough")
	_, err = idem.New[string](base(), nil)
	require.ErrorContains(t, err, "handler is required")
}
