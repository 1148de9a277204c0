package config

import (
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
)

// Validate returns an error naming the first bad field by its yaml path.
func (c Config) Validate() error {
	for _, check := range []func() error{c.validateConnections, c.validateRedisTLS, c.validateNames, c.validateRanges, c.validateAgreement, c.validateOutbox} {
		if err := check(); err != nil {
			return err
		}
	}
	return nil
}

// bad is a validation error naming field.
func bad(field, format string, args ...any) error {
	return fmt.Errorf("config: %s: %s", field, fmt.Sprintf(format, args...))
}

// validateConnections checks the URLs with their client libraries' parsers.
func (c Config) validateConnections() error {
	for field, v := range map[string]string{"amqp_url": c.AMQPURL, "database_url": c.DatabaseURL, "queue": c.Queue} {
		if v == "" {
			return bad(field, "must not be empty")
		}
	}
	if c.Redis.Enabled && c.RedisURL == "" {
		return bad("redis_url", "must not be empty while redis.enabled is true")
	}
	// Each URL through its client library's own parser, so that a typo
	// stops the start instead of a reconnect loop. (Their errors may quote
	// the URL; the command's output is redacted.)
	for _, u := range broker.SplitURLs(c.AMQPURL) {
		if _, err := amqp.ParseURI(u); err != nil {
			return bad("amqp_url", "cannot be parsed as an AMQP URL (amqp:// or amqps://, host, port, vhost; several separated by commas): %v", err)
		}
	}
	if c.Redis.Enabled {
		if _, err := parseRedisURL(c.Redis.Mode, c.RedisURL); errors.Is(err, errRedisMode) {
			return bad("redis.mode", "%v", err)
		} else if err != nil {
			return bad("redis_url", "%v", err)
		}
	}
	if _, err := pgxpool.ParseConfig(c.DatabaseURL); err != nil {
		return bad("database_url", "cannot be parsed as a PostgreSQL URL or DSN: %v", err)
	}
	shards := strings.Fields(c.Postgres.Shards)
	for i, u := range shards {
		if _, err := pgxpool.ParseConfig(u); err != nil {
			return bad("postgres.shards", "shard %d cannot be parsed as a PostgreSQL URL (list URLs separated by spaces): %v", i, err)
		}
		if slices.Contains(shards[:i], u) {
			return bad("postgres.shards", "shard %d repeats an earlier shard's URL", i)
		}
	}
	return nil
}

// validateNames checks the settings that name something: the scope, the
// log level and format, the untimed policy.
func (c Config) validateNames() error {
	if err := guard.ValidateScope(c.Scope); err != nil {
		return bad("scope", "%v", err)
	}
	if _, err := ParseLevel(c.LogLevel); err != nil {
		return bad("log_level", "%v", err)
	}
	if c.LogFormat != "text" && c.LogFormat != "json" {
		return bad("log_format", "%q is not a format; want text or json", c.LogFormat)
	}
	switch consumer.UntimedPolicy(c.Consumer.Untimed) {
	case consumer.UntimedAuto, consumer.UntimedReject:
	case "accept":
		return bad("consumer.untimed", "accept was removed: it could apply an untimed event twice after a prune; auto accepts untimed events until the first prune and is safe")
	default:
		return bad("consumer.untimed", "%q is not a policy; want auto or reject", c.Consumer.Untimed)
	}
	return nil
}

// validateRanges checks each number and duration against its range.
func (c Config) validateRanges() error {
	for _, n := range c.HistoryWithout() {
		if _, ok := pgtier.HistoryParts[n]; !ok {
			return bad("postgres.history_without", "%q is no part of the history; want any of pg_control_system, pg_walfile_name, pg_postmaster_start_time, pg_relation_filenode", n)
		}
	}
	if c.Postgres.PruneInterval != 0 && (c.Postgres.PruneInterval < time.Second || c.Postgres.PruneInterval > 24*time.Hour) {
		return bad("postgres.prune_interval", "%s is out of range; want 0 (off) or 1s to 1d", c.Postgres.PruneInterval)
	}
	if c.Heartbeat != 0 && (c.Heartbeat < 100*time.Millisecond || c.Heartbeat > time.Minute) {
		return bad("heartbeat", "%s is out of range; want 0 (off) or 100ms to 1m", c.Heartbeat)
	}
	ints := []struct {
		field  string
		v      int64
		lo, hi int64
		why    string
	}{
		{"partitions", int64(c.Partitions), 1, 4096, ""},
		{"consumer.prefetch", int64(c.Consumer.Prefetch), 1, 65535, " (AMQP carries it in 16 bits)"},
		{"consumer.workers", int64(c.Consumer.Workers), 1, 1024, ""},
		{"consumer.batch_size", int64(c.Consumer.BatchSize), 1, 65535, ""},
		{"consumer.delivery_limit", int64(c.Consumer.DeliveryLimit), 1, 1000, ""},
		{"consumer.broker_delivery_limit", int64(c.Consumer.BrokerDeliveryLimit), 1, 10000, ""},
		{"consumer.max_body_bytes", int64(c.Consumer.MaxBodyBytes), 1 << 10, 512 << 20, " (RabbitMQ's largest max_message_size)"},
		{"postgres.max_conns", int64(c.Postgres.MaxConns), 1, 1000, ""},
		{"redis.breaker_failures", int64(c.Redis.BreakerFailures), 1, 1000, ""},
		{"redis.breaker_half_open_requests", int64(c.Redis.BreakerHalfOpenRequests), 1, 100, ""},
	}
	for _, r := range ints {
		if r.v < r.lo || r.v > r.hi {
			return bad(r.field, "%d is out of range; want %d to %d%s", r.v, r.lo, r.hi, r.why)
		}
	}
	const day = 24 * time.Hour
	durations := []struct {
		field  string
		v      time.Duration
		lo, hi time.Duration
	}{
		{"consumer.handler_timeout", c.Consumer.HandlerTimeout, 10 * time.Millisecond, time.Hour},
		{"consumer.batch_linger", c.Consumer.BatchLinger, 100 * time.Microsecond, time.Second},
		{"consumer.drain_timeout", c.Consumer.DrainTimeout, 100 * time.Millisecond, time.Hour},
		{"consumer.retry_backoff_min", c.Consumer.RetryBackoffMin, time.Millisecond, time.Minute},
		{"consumer.retry_backoff_max", c.Consumer.RetryBackoffMax, time.Millisecond, time.Hour},
		{"consumer.reconnect_backoff_min", c.Consumer.ReconnectBackoffMin, time.Millisecond, time.Minute},
		{"consumer.reconnect_backoff_max", c.Consumer.ReconnectBackoffMax, time.Millisecond, time.Hour},
		{"consumer.confirm_timeout", c.Consumer.ConfirmTimeout, 100 * time.Millisecond, 10 * time.Minute},
		{"consumer.store_hold", c.Consumer.StoreHold, time.Second, 25 * time.Minute},
		{"consumer.clock_skew", c.Consumer.ClockSkew, time.Second, day},
		{"consumer.startup_timeout", c.Consumer.StartupTimeout, time.Second, day},
		{"postgres.retention", c.Postgres.Retention, time.Hour, 10 * 365 * day},
		{"redis.lease", c.Redis.Lease, 100 * time.Millisecond, day},
		{"redis.done_ttl", c.Redis.DoneTTL, time.Second, 10 * 365 * day},
		{"redis.timeout", c.Redis.Timeout, time.Millisecond, 10 * time.Second},
		{"redis.breaker_open_timeout", c.Redis.BreakerOpenTimeout, 100 * time.Millisecond, 10 * time.Minute},
		{"redis.breaker_min_outage", c.Redis.BreakerMinOutage, time.Millisecond, time.Minute},
	}
	for _, r := range durations {
		if r.v < r.lo || r.v > r.hi {
			return bad(r.field, "%s is out of range; want %s to %s", r.v, fmtDuration(r.lo), fmtDuration(r.hi))
		}
	}
	return c.validateKillSwitch()
}

// validateKillSwitch checks the kill switch's settings; an unused switch's
// are not checked.
func (c Config) validateKillSwitch() error {
	k := c.Consumer
	switch {
	case !k.KillSwitch:
		return nil
	case k.KillSwitchThreshold < 1 || k.KillSwitchThreshold > 100000:
		return bad("consumer.kill_switch_threshold", "%d is out of range; want 1 to 100000", k.KillSwitchThreshold)
	case !(k.KillSwitchRate > 0 && k.KillSwitchRate <= 1):
		return bad("consumer.kill_switch_rate", "%g is out of range; want above 0 and at most 1 (0.5: half of the window's events)", k.KillSwitchRate)
	case k.KillSwitchWindow < time.Second || k.KillSwitchWindow > time.Hour:
		return bad("consumer.kill_switch_window", "%s is out of range; want 1s to 1h", k.KillSwitchWindow)
	case k.KillSwitchProbeMin < 10*time.Millisecond || k.KillSwitchProbeMin > time.Hour:
		return bad("consumer.kill_switch_probe_min", "%s is out of range; want 10ms to 1h", k.KillSwitchProbeMin)
	case k.KillSwitchProbeMax < k.KillSwitchProbeMin || k.KillSwitchProbeMax > 24*time.Hour:
		return bad("consumer.kill_switch_probe_max", "%s is out of range; want consumer.kill_switch_probe_min (%s) to 1d", k.KillSwitchProbeMax, k.KillSwitchProbeMin)
	}
	return nil
}

// validateAgreement checks the settings that must agree with each other,
// across the tiers too.
func (c Config) validateAgreement() error {
	switch {
	case c.Consumer.BrokerDeliveryLimit < c.Consumer.DeliveryLimit:
		return bad("consumer.broker_delivery_limit", "%d is below consumer.delivery_limit (%d); the broker would dead-letter retries the consumer still wants",
			c.Consumer.BrokerDeliveryLimit, c.Consumer.DeliveryLimit)
	case c.Consumer.BatchSize > c.Consumer.Prefetch:
		return bad("consumer.batch_size", "%d exceeds consumer.prefetch (%d); a batch is gathered from the unacked deliveries", c.Consumer.BatchSize, c.Consumer.Prefetch)
	case c.Consumer.RetryBackoffMax < c.Consumer.RetryBackoffMin:
		return bad("consumer.retry_backoff_max", "%s is below consumer.retry_backoff_min (%s)", c.Consumer.RetryBackoffMax, c.Consumer.RetryBackoffMin)
	case c.Consumer.ReconnectBackoffMax < c.Consumer.ReconnectBackoffMin:
		return bad("consumer.reconnect_backoff_max", "%s is below consumer.reconnect_backoff_min (%s)", c.Consumer.ReconnectBackoffMax, c.Consumer.ReconnectBackoffMin)
	case c.Redis.Enabled && c.Redis.DoneTTL > c.Postgres.Retention:
		return bad("redis.done_ttl", "%s exceeds postgres.retention (%s); Redis would vouch for events the authoritative table has forgotten",
			c.Redis.DoneTTL, c.Postgres.Retention)
	case c.Redis.Enabled && strings.Contains(c.Redis.Prefix, ":"):
		return bad("redis.prefix", "%q may not contain ':'", c.Redis.Prefix)
	case c.Redis.Enabled && c.Redis.Timeout >= c.Consumer.HandlerTimeout:
		return bad("redis.timeout", "%s must be well below consumer.handler_timeout (%s), since Redis is only an optimisation", c.Redis.Timeout, c.Consumer.HandlerTimeout)
	}
	return nil
}

// validateOutbox checks the outbox and relay settings.
func (c Config) validateOutbox() error {
	if c.Handler != "" && c.Handler != HandlerPayments && c.Handler != HandlerReceipts {
		return bad("handler", "%q is not a reference handler; want payments or receipts (or nothing: payments)", c.Handler)
	}
	dests, err := relay.ParseDestinations(c.Outbox.Destinations)
	if err != nil {
		return bad("outbox.destinations", "%v", err)
	}
	refs, err := parseHeaders(c.Outbox.Headers)
	if err != nil {
		return bad("outbox.headers", "%v", err)
	}
	if err := validateHeaders(refs, dests); err != nil {
		return err
	}
	final, err := parseFinalStatuses(c.Outbox.FinalStatuses)
	if err != nil {
		return bad("outbox.final_statuses", "%v", err)
	}
	for _, name := range slices.Sorted(maps.Keys(final)) {
		switch d, ok := dests[name]; {
		case !ok:
			return bad("outbox.final_statuses", "%q is not one of outbox.destinations", name)
		case d.Kind != relay.HTTP:
			return bad("outbox.final_statuses", "%q is %s, not an http(s) URL; only HTTP destinations answer with a status", name, d)
		}
	}
	if _, ok := dests[c.Outbox.Emit]; c.Outbox.Emit != "" && len(dests) > 0 && !ok {
		return bad("outbox.emit", "%q is not one of outbox.destinations (%s)", c.Outbox.Emit, strings.Join(relay.Names(dests), ", "))
	}
	if c.Outbox.Relay && len(dests) == 0 {
		return bad("outbox.relay", "a relay needs outbox.destinations")
	}
	o := c.Outbox
	switch {
	case o.BatchSize < 1 || o.BatchSize > 4096:
		return bad("outbox.batch_size", "%d is out of range; want 1 to 4096", o.BatchSize)
	case o.MaxAttempts < 1 || o.MaxAttempts > 10000:
		return bad("outbox.max_attempts", "%d is out of range; want 1 to 10000", o.MaxAttempts)
	case o.PollInterval < 10*time.Millisecond || o.PollInterval > time.Hour:
		return bad("outbox.poll_interval", "%s is out of range; want 10ms to 1h", o.PollInterval)
	case o.BackoffMin < time.Millisecond || o.BackoffMin > o.BackoffMax:
		return bad("outbox.backoff_min", "%s is out of range; want 1ms to outbox.backoff_max (%s)", o.BackoffMin, o.BackoffMax)
	case o.BackoffMax > 24*time.Hour:
		return bad("outbox.backoff_max", "%s is out of range; want at most 1d", o.BackoffMax)
	case o.PublishTimeout < 100*time.Millisecond || o.PublishTimeout > 10*time.Minute:
		return bad("outbox.publish_timeout", "%s is out of range; want 100ms to 10m", o.PublishTimeout)
	case o.DoneStatus != 0 && (o.DoneStatus < 300 || o.DoneStatus > 499 || o.DoneStatus == 429 || o.DoneStatus == 408):
		return bad("outbox.done_status", "%d is not an answer that can mean done; want 0 (2xx only) or a 3xx/4xx other than 408 and 429", o.DoneStatus)
	case o.Retention < 0 || o.Retention > 365*24*time.Hour:
		return bad("outbox.retention", "%s is out of range; want 0 (delete once sent) to 365d", o.Retention)
	}
	return nil
}

// fmtDuration prints whole days as such, so that ranges read 10d not 87600h0m0s.
func fmtDuration(d time.Duration) string {
	if d >= 24*time.Hour && d%(24*time.Hour) == 0 {
		return fmt.Sprintf("%dd", d/(24*time.Hour))
	}
	return d.String()
}

// Warnings lists legal settings that are probably mistakes.
func (c Config) Warnings() []string {
	var w []string
	if c.Redis.Enabled && c.Redis.Lease < c.Consumer.HandlerTimeout {
		w = append(w, fmt.Sprintf("redis.lease (%s) is shorter than consumer.handler_timeout (%s): a slow handler's lease can expire and a duplicate will wait on Postgres instead of being deferred cheaply (still processed once)",
			c.Redis.Lease, c.Consumer.HandlerTimeout))
	}
	if c.Consumer.BatchSize > c.Consumer.Prefetch {
		w = append(w, fmt.Sprintf("consumer.batch_size (%d) exceeds consumer.prefetch (%d): batches hold at most %d deliveries",
			c.Consumer.BatchSize, c.Consumer.Prefetch, c.Consumer.Prefetch))
	} else if c.Consumer.Prefetch < c.Consumer.Workers*c.Consumer.BatchSize/2 {
		w = append(w, fmt.Sprintf("consumer.prefetch (%d) is below half of consumer.workers × consumer.batch_size (%d × %d): some workers will idle or run small batches",
			c.Consumer.Prefetch, c.Consumer.Workers, c.Consumer.BatchSize))
	}
	if c.Postgres.Retention < 24*time.Hour {
		w = append(w, fmt.Sprintf("postgres.retention (%s) is under a day: a dead-letter replay older than that is refused", c.Postgres.Retention))
	}
	return append(w, c.tlsWarnings()...)
}

// ParseLevel parses a log level name.
func ParseLevel(s string) (slog.Level, error) {
	var l slog.Level
	err := l.UnmarshalText([]byte(s))
	return l, err
}
