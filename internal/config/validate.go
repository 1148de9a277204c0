package config

import (
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/idemhq/idem/pkg/guard"
)

// Validate returns an error naming the first bad field by its yaml path.
func (c Config) Validate() error {
	bad := func(field, format string, args ...any) error {
		return fmt.Errorf("config: %s: %s", field, fmt.Sprintf(format, args...))
	}
	for field, v := range map[string]string{"amqp_url": c.AMQPURL, "database_url": c.DatabaseURL, "queue": c.Queue} {
		if v == "" {
			return bad(field, "must not be empty")
		}
	}
	if c.Redis.Enabled && c.RedisURL == "" {
		return bad("redis_url", "must not be empty while redis.enabled is true")
	}
	if err := guard.ValidateScope(c.Scope); err != nil {
		return bad("scope", "%v", err)
	}
	if _, err := ParseLevel(c.LogLevel); err != nil {
		return bad("log_level", "%v", err)
	}
	positive := []struct {
		field string
		v     int64
	}{
		{"consumer.prefetch", int64(c.Consumer.Prefetch)},
		{"consumer.workers", int64(c.Consumer.Workers)},
		{"consumer.delivery_limit", int64(c.Consumer.DeliveryLimit)},
		{"consumer.handler_timeout", int64(c.Consumer.HandlerTimeout)},
		{"consumer.drain_timeout", int64(c.Consumer.DrainTimeout)},
		{"consumer.retry_backoff_min", int64(c.Consumer.RetryBackoffMin)},
		{"postgres.retention", int64(c.Postgres.Retention)},
		{"postgres.max_conns", int64(c.Postgres.MaxConns)},
	}
	if c.Redis.Enabled {
		positive = append(positive, []struct {
			field string
			v     int64
		}{
			{"redis.lease", int64(c.Redis.Lease)},
			{"redis.done_ttl", int64(c.Redis.DoneTTL)},
			{"redis.timeout", int64(c.Redis.Timeout)},
			{"redis.breaker_failures", int64(c.Redis.BreakerFailures)},
			{"redis.breaker_open_timeout", int64(c.Redis.BreakerOpenTimeout)},
			{"redis.breaker_half_open_requests", int64(c.Redis.BreakerHalfOpenRequests)},
		}...)
	}
	for _, p := range positive {
		if p.v <= 0 {
			return bad(p.field, "must be positive")
		}
	}
	switch {
	case c.Consumer.BrokerDeliveryLimit < c.Consumer.DeliveryLimit:
		return bad("consumer.broker_delivery_limit", "%d is below consumer.delivery_limit (%d): the broker would dead-letter retries the consumer still wants",
			c.Consumer.BrokerDeliveryLimit, c.Consumer.DeliveryLimit)
	case c.Consumer.RetryBackoffMax < c.Consumer.RetryBackoffMin:
		return bad("consumer.retry_backoff_max", "%s is below consumer.retry_backoff_min (%s)", c.Consumer.RetryBackoffMax, c.Consumer.RetryBackoffMin)
	case c.Redis.Enabled && c.Redis.DoneTTL > c.Postgres.Retention:
		return bad("redis.done_ttl", "%s exceeds postgres.retention (%s): Redis would vouch for events the authoritative table has forgotten",
			c.Redis.DoneTTL, c.Postgres.Retention)
	case c.Redis.Enabled && strings.Contains(c.Redis.Prefix, ":"):
		return bad("redis.prefix", "%q may not contain ':'", c.Redis.Prefix)
	case c.Redis.Enabled && c.Redis.Timeout >= c.Consumer.HandlerTimeout:
		return bad("redis.timeout", "%s must be well below consumer.handler_timeout (%s): Redis is an optimisation", c.Redis.Timeout, c.Consumer.HandlerTimeout)
	}
	return nil
}

// Warnings lists legal settings that are probably mistakes.
func (c Config) Warnings() []string {
	var w []string
	if c.Redis.Enabled && c.Redis.Lease < c.Consumer.HandlerTimeout {
		w = append(w, fmt.Sprintf("redis.lease (%s) is shorter than consumer.handler_timeout (%s): a slow handler's lease can expire and a duplicate will wait on Postgres instead of being deferred cheaply (still processed once)",
			c.Redis.Lease, c.Consumer.HandlerTimeout))
	}
	if c.Consumer.Prefetch < c.Consumer.Workers {
		w = append(w, fmt.Sprintf("consumer.prefetch (%d) is below consumer.workers (%d): some workers will idle", c.Consumer.Prefetch, c.Consumer.Workers))
	}
	if c.Postgres.Retention < 24*time.Hour {
		w = append(w, fmt.Sprintf("postgres.retention (%s) is under a day: a dead-letter replay older than that is refused", c.Postgres.Retention))
	}
	return w
}

// ParseLevel parses a log level name.
func ParseLevel(s string) (slog.Level, error) {
	var l slog.Level
	err := l.UnmarshalText([]byte(s))
	return l, err
}
