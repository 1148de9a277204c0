// Package config loads idem's settings: defaults, then an optional YAML file,
// then environment variables, then validation that names the bad field.
package config

import (
	"fmt"
	"github.com/idemhq/idem/internal/heartbeat"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard/redistier"
)

// Defaults. The connection URLs point at the local services.
const (
	DefaultAMQPURL     = "amqp://guest:guest@127.0.0.1:5672/"
	DefaultRedisURL    = "redis://127.0.0.1:6379/0"
	DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	DefaultQueue       = "payments.events"
	DefaultScope       = "payments"
)

// Config is everything `idem consume` and its siblings read. Each field's yaml
// path, upper-cased with dots as underscores and prefixed IDEM_, is its
// environment variable (redis.done_ttl ⇒ IDEM_REDIS_DONE_TTL), except the
// three URLs, which use the conventional names.
type Config struct {
	// AMQPURL is the RabbitMQ URL, or the URLs of a cluster's nodes
	// separated by commas: consumers connect to the first that answers and
	// move to another when they lose theirs. Env AMQP_URL. Defaults to
	// DefaultAMQPURL.
	AMQPURL string `yaml:"amqp_url" env:"AMQP_URL"`
	// RedisURL is the Redis URL, parsed by go-redis as redis.mode says:
	// one server (redis://host:6379/0); a cluster, one node in the host
	// and the others as addr parameters
	// (redis://host:7001?addr=host:7002&addr=host:7003); or Sentinels,
	// the same way, with the master's name
	// (redis://host:26379?addr=host:26380&master_name=mymaster). Env
	// REDIS_URL. Defaults to DefaultRedisURL.
	RedisURL string `yaml:"redis_url" env:"REDIS_URL"`
	// DatabaseURL is the PostgreSQL URL, parsed by pgx; add
	// search_path=<schema> to use another schema. Env DATABASE_URL.
	// Defaults to DefaultDatabaseURL.
	DatabaseURL string `yaml:"database_url" env:"DATABASE_URL"`
	// Queue is the queue name. Defaults to DefaultQueue.
	Queue string `yaml:"queue"`
	// Partitions splits the stream over this many quorum queues,
	// <queue>.0 to <queue>.<n-1>, each event to the partition of its
	// userId; 1 is the one queue <queue>. Publishers and consumers must
	// agree on it. Defaults to 1.
	Partitions int `yaml:"partitions"`
	// Scope namespaces event IDs in Redis and Postgres: the consuming
	// service's name. Defaults to DefaultScope.
	Scope string `yaml:"scope"`
	// LogLevel is debug, info, warn or error. Defaults to info.
	LogLevel string `yaml:"log_level"`
	// LogFormat is text (logfmt) or json (one object per line). Defaults
	// to text.
	LogFormat string `yaml:"log_format"`
	// MetricsAddr, if set, serves Prometheus metrics at /metrics and the
	// /healthz and /readyz probes on this address.
	MetricsAddr string `yaml:"metrics_addr"`
	// Heartbeat is how often each consumer and relay reports itself in
	// the (first) database's idem_instance table, for idem console: ready
	// or why not, its kill switch and breaker, its outcome counts. 0
	// reports nothing. Defaults to 5s.
	Heartbeat time.Duration `yaml:"heartbeat"`

	// Handler is the reference handler idem consume runs: payments
	// (PAYMENT_COMPLETED into payments_ledger and account_balances) or
	// receipts (RECEIPT_REQUESTED, which payments sends through the
	// outbox, into receipts); empty runs payments. idem migrate creates
	// the reference handlers' tables only when it is set, so that it
	// leaves another service's database with idem's own tables alone.
	// Defaults to empty.
	Handler string `yaml:"handler"`

	Consumer Consumer `yaml:"consumer"`
	Redis    Redis    `yaml:"redis"`
	Postgres Postgres `yaml:"postgres"`
	Outbox   Outbox   `yaml:"outbox"`
	Inspect  Inspect  `yaml:"inspect"`
}

// Inspect configures what idem inspect shows of a service's own tables.
type Inspect struct {
	// Effects is a read-only SQL query, with the event ID as $1, returning
	// one row per time the event's effect was applied (the rows it wrote,
	// keyed by event ID): idem inspect prints each row, counts them in its
	// verdict, and runs it in a READ ONLY transaction. Empty: the reference
	// handler's payments_ledger where the schema has it, else no effects
	// line. Defaults to empty.
	Effects string `yaml:"effects"`
}

// Outbox configures the messages handlers send to other systems, and the
// relay that publishes them (idem relay, or outbox.relay in idem consume).
type Outbox struct {
	// Emit, if set, names the destination the reference handler sends its
	// follow-up message to through the outbox: payments sends a
	// RECEIPT_REQUESTED per payment, receipts POSTs each receipt. Empty:
	// none. Defaults to empty.
	Emit string `yaml:"emit"`
	// Relay runs a relay inside idem consume. Defaults to false.
	Relay bool `yaml:"relay"`
	// Destinations names where messages go, name=target separated by
	// spaces: queue:<queue>[/<partitions>] (an idem stream, routed by the
	// message's key), exchange:<exchange>[/<routing key>], or an http(s)
	// URL (POST, Idempotency-Key = the message ID). Defaults to empty.
	Destinations string `yaml:"destinations"`
	// Headers adds headers to an http(s) destination's requests (a bearer
	// token, an API key): <destination>:<Header-Name>=env:<VARIABLE>,
	// separated by spaces. Each value is read from the environment
	// variable at start and masked in every output; a literal value is
	// refused, so that no secret sits in a config file. Defaults to empty.
	Headers string `yaml:"headers"`
	// header is Headers with its values read, by Load: destination name ⇒
	// its requests' headers.
	header map[string]http.Header
	// FinalStatuses sets, per http(s) destination, which answers are
	// final (the row dead at once): <destination>=<statuses>, separated by
	// spaces, where <statuses> lists statuses and ranges, 300 to 599,
	// separated by commas, or "none". A destination not named keeps the default: a 3xx or 4xx
	// but 401, 403, 408, 425 and 429. Any other failing answer is tried
	// again, and pauses the destination when distinct rows keep failing
	// alike. Defaults to empty.
	FinalStatuses string `yaml:"final_statuses"`
	// BatchSize is the most rows one relay pass claims. Defaults to 500.
	BatchSize int `yaml:"batch_size"`
	// PollInterval is how often an idle relay looks for rows without a
	// notification. Defaults to 1s.
	PollInterval time.Duration `yaml:"poll_interval"`
	// MaxAttempts is how many failed publishes make a row dead (idem
	// outbox replay brings it back). Defaults to 20.
	MaxAttempts int `yaml:"max_attempts"`
	// BackoffMin is the wait before a failed row's second attempt,
	// doubling after. Defaults to 1s.
	BackoffMin time.Duration `yaml:"backoff_min"`
	// BackoffMax caps the wait between attempts. Defaults to 5m.
	BackoffMax time.Duration `yaml:"backoff_max"`
	// PublishTimeout bounds the wait for a pass's confirms and for one
	// HTTP request. Defaults to 10s.
	PublishTimeout time.Duration `yaml:"publish_timeout"`
	// DoneStatus, if set, is the HTTP status an API answers for a key it
	// already completed, counted as sent like a 2xx. Never a status the
	// API also answers while a request with that key is still in progress
	// (Stripe's 409 is one). Defaults to 0 (none).
	DoneStatus int `yaml:"done_status"`
	// Retention is how long sent rows are kept, for idem inspect; 0
	// deletes a row once it is sent. Defaults to 24h.
	Retention time.Duration `yaml:"retention"`
}

// Consumer tunes the RabbitMQ consumer runtime.
type Consumer struct {
	// Prefetch is the most unacked deliveries per process. Defaults to 1024.
	Prefetch int `yaml:"prefetch"`
	// Workers is batches (with batch_size 1, deliveries) handled at once
	// per process. Defaults to 2.
	Workers int `yaml:"workers"`
	// BatchSize is the most deliveries handled in one transaction; 1
	// handles each on its own. At most prefetch. Defaults to 256, or
	// prefetch if lower.
	BatchSize int `yaml:"batch_size"`
	// BatchLinger is how long a batch that is not full waits for more
	// deliveries while no other batch is in flight (three times as long
	// while one is); it bounds the latency batching adds. Defaults to 5ms.
	BatchLinger time.Duration `yaml:"batch_linger"`
	// KeyOrder applies one user's events in the order the consumer received
	// them, within a partition (see consumer.Config.KeyOrder): for handlers
	// where a refund must follow its payment. Costs throughput (idem-lab bench
	// row "batched, key order, 25%"). Defaults to false.
	KeyOrder bool `yaml:"key_order"`
	// DeliveryLimit is attempts for a failing handler before the message is
	// dead-lettered. Defaults to 5.
	DeliveryLimit int `yaml:"delivery_limit"`
	// BrokerDeliveryLimit is the queue's x-delivery-limit, the broker's
	// backstop for messages that crash every consumer. Defaults to 20.
	BrokerDeliveryLimit int `yaml:"broker_delivery_limit"`
	// HandlerTimeout bounds one attempt (claim, handler, commit).
	// Defaults to 10s.
	HandlerTimeout time.Duration `yaml:"handler_timeout"`
	// MaxBodyBytes is the longest message body, in bytes, the handler
	// decodes; a longer one is dead-lettered as body_too_large, truncated.
	// Defaults to 1 MiB (1048576).
	MaxBodyBytes int `yaml:"max_body_bytes"`
	// DrainTimeout is how long in-flight work may finish after SIGTERM.
	// Defaults to 30s.
	DrainTimeout time.Duration `yaml:"drain_timeout"`
	// RetryBackoffMin is the first retry delay. Defaults to 200ms.
	RetryBackoffMin time.Duration `yaml:"retry_backoff_min"`
	// RetryBackoffMax caps retry delays. Defaults to 10s.
	RetryBackoffMax time.Duration `yaml:"retry_backoff_max"`
	// ReconnectBackoffMin is the first delay before reconnecting to
	// RabbitMQ (jittered, doubling). Defaults to 100ms.
	ReconnectBackoffMin time.Duration `yaml:"reconnect_backoff_min"`
	// ReconnectBackoffMax caps reconnection delays. Defaults to
	// 10s.
	ReconnectBackoffMax time.Duration `yaml:"reconnect_backoff_max"`
	// ConfirmTimeout bounds the wait for the broker's confirm of a dead
	// letter. Defaults to 10s.
	ConfirmTimeout time.Duration `yaml:"confirm_timeout"`
	// StoreHold bounds how long a delivery is retried in place while
	// Postgres is unreachable before it goes back to the queue. Keep it
	// under RabbitMQ's consumer_timeout (30m by default). Defaults to 1m.
	StoreHold time.Duration `yaml:"store_hold"`
	// ClockSkew is how far ahead of the clock an event's time may be before
	// it is refused as future_timestamp; recorded in idem_horizon, where
	// the claim enforces the largest recorded and prune cuts by it. At
	// least 1s. Defaults to 5m.
	ClockSkew time.Duration `yaml:"clock_skew"`
	// Untimed is what happens to an event with no time (no occurredAt in
	// the body, no AMQP timestamp): "auto" processes it while no dedup row
	// was ever pruned, and refuses it as missing_time after a prune unless
	// its row exists; "reject" dead-letters it as missing_time at once.
	// Neither can apply it twice. Defaults to auto.
	Untimed string `yaml:"untimed"`
	// StartupTimeout bounds how long start-up waits for PostgreSQL and
	// RabbitMQ to come up before it gives up and exits. Defaults to 2m.
	StartupTimeout time.Duration `yaml:"startup_timeout"`
	// KillSwitch stops consuming when distinct events all fail the same
	// way (a broken deploy: a missing table, a revoked permission), hands
	// back what it holds without spending it, reports not ready, and probes
	// with one delivery until an event is processed (see
	// consumer.KillSwitch). false lets every failure take the retry and
	// dead-letter path alone. Defaults to true.
	KillSwitch bool `yaml:"kill_switch"`
	// KillSwitchThreshold is how many distinct events must fail with one
	// error class (a SQLSTATE, else a reason) within kill_switch_window to
	// trip the switch. Defaults to 5.
	KillSwitchThreshold int `yaml:"kill_switch_threshold"`
	// KillSwitchRate is the least share of the window's events those
	// failures must be, above 0 and at most 1: a poison message among good
	// ones never trips it. Defaults to 0.5.
	KillSwitchRate float64 `yaml:"kill_switch_rate"`
	// KillSwitchWindow is how far back failures count. Defaults to 1m.
	KillSwitchWindow time.Duration `yaml:"kill_switch_window"`
	// KillSwitchProbeMin is the wait after a trip before the first probe;
	// each failed probe doubles it (jittered). Defaults to 10s.
	KillSwitchProbeMin time.Duration `yaml:"kill_switch_probe_min"`
	// KillSwitchProbeMax caps the wait between probes. Defaults to 5m.
	KillSwitchProbeMax time.Duration `yaml:"kill_switch_probe_max"`
}

// Redis tunes the fast tier.
type Redis struct {
	// Enabled turns the fast tier on. With false every event goes to
	// Postgres. Defaults to true.
	Enabled bool `yaml:"enabled"`
	// Mode is single (one server, or a proxy), cluster (Redis Cluster:
	// the client routes each key to its slot's master and follows
	// failovers) or sentinel (a master and replicas watched by Sentinel:
	// the client asks the Sentinels for the master). Defaults to single.
	Mode string `yaml:"mode"`
	// Prefix starts every key. Defaults to "idem".
	Prefix string `yaml:"prefix"`
	// Lease is the pending-lease TTL; longer than a handler run.
	// Defaults to 30s.
	Lease time.Duration `yaml:"lease"`
	// DoneTTL is how long a done marker drops duplicates without Postgres.
	// Memory is about 100 bytes per event in this window. Defaults to 24h.
	DoneTTL time.Duration `yaml:"done_ttl"`
	// Timeout bounds every Redis call. Defaults to 50ms.
	Timeout time.Duration `yaml:"timeout"`
	// BreakerFailures is consecutive failures that open the breaker.
	// Defaults to 5.
	BreakerFailures uint32 `yaml:"breaker_failures"`
	// BreakerMinOutage is how long calls must keep failing before the
	// breaker opens, so that a busy machine missing a few deadlines does
	// not open it. Defaults to 250ms.
	BreakerMinOutage time.Duration `yaml:"breaker_min_outage"`
	// BreakerOpenTimeout is how long the breaker stays open before probing.
	// Defaults to 5s.
	BreakerOpenTimeout time.Duration `yaml:"breaker_open_timeout"`
	// BreakerHalfOpenRequests is probes allowed while half-open.
	// Defaults to 1.
	BreakerHalfOpenRequests uint32 `yaml:"breaker_half_open_requests"`
	// TLSCAFile is a PEM file of the CA certificates that sign the
	// servers' certificates, trusted instead of the system's; it needs a
	// rediss:// redis_url. Defaults to empty (the system's CAs).
	TLSCAFile string `yaml:"tls_ca_file"`
	// TLSCertFile is a PEM client certificate, for servers that ask for
	// one (tls-auth-clients); set it with tls_key_file. Defaults to empty.
	TLSCertFile string `yaml:"tls_cert_file"`
	// TLSKeyFile is tls_cert_file's PEM private key. Defaults to empty.
	TLSKeyFile string `yaml:"tls_key_file"`
	// TLSServerName is the name every server's certificate must carry.
	// Empty: each server's own host, as the client dials it (in cluster
	// and sentinel mode, each node's address, not redis_url's first
	// host). Defaults to empty.
	TLSServerName string `yaml:"tls_server_name"`
}

// Postgres tunes the authoritative tier.
type Postgres struct {
	// Retention is how long dedup rows are kept (idem prune deletes older
	// ones). It must cover the longest redelivery, including a dead-letter
	// replay; consumers refuse messages published longer ago. Defaults to 720h.
	Retention time.Duration `yaml:"retention"`
	// MaxConns caps the connection pool. Defaults to workers + 4.
	MaxConns int32 `yaml:"max_conns"`
	// Shards, if set, splits the authoritative tier over several
	// databases: their URLs separated by spaces or newlines, in a fixed
	// order (shard 0 first). Each holds the dedup rows and the effects of
	// the keys (userIds) that partition.Of maps to it, and records its
	// place, so a reordered or resized list is refused at start. It
	// replaces database_url. Env IDEM_POSTGRES_SHARDS. Defaults to empty.
	Shards string `yaml:"shards"`
	// PruneInterval, if set, makes each consumer run idem prune's deletion
	// this often (counted in idem_retention_rows_pruned_total). Zero
	// leaves pruning to idem prune. Defaults to 0.
	PruneInterval time.Duration `yaml:"prune_interval"`
	// HistoryWithout leaves parts of the database's history out, for a
	// managed service that refuses their functions: any of
	// pg_control_system, pg_walfile_name, pg_postmaster_start_time,
	// pg_relation_filenode, separated by spaces or commas. A weaker
	// guarantee, taken knowingly: an event the database lost in a way the
	// part would have told (a restore, a failover), re-sent while Redis
	// still holds its done marker, is dropped as a duplicate (see
	// docs/operations.md, "Managed PostgreSQL"). Defaults to empty: every
	// function is needed, and a missing one is refused at start by name.
	HistoryWithout string `yaml:"history_without"`
}

// HistoryWithout is postgres.history_without as a list.
func (c Config) HistoryWithout() []string {
	return strings.FieldsFunc(c.Postgres.HistoryWithout, func(r rune) bool { return r == ',' || r == ' ' || r == '\n' || r == '\t' })
}

// Default returns the configuration with every default filled in: the
// tuning defaults are the packages' own (consumer.Config.WithDefaults,
// redistier.Config.WithDefaults), so a setting left out of the file runs
// exactly as a library user's would.
func Default() Config {
	c := consumer.Config{}.WithDefaults()
	r := redistier.Config{}.WithDefaults()
	o := relay.Config{}.WithDefaults()
	return Config{
		AMQPURL:     DefaultAMQPURL,
		RedisURL:    DefaultRedisURL,
		DatabaseURL: DefaultDatabaseURL,
		Queue:       DefaultQueue,
		Partitions:  1,
		Scope:       DefaultScope,
		LogLevel:    "info",
		LogFormat:   "text",
		Heartbeat:   heartbeat.DefaultEvery,
		Consumer: Consumer{
			Prefetch:            c.Prefetch,
			Workers:             c.Workers,
			BatchSize:           c.BatchSize,
			BatchLinger:         c.BatchLinger,
			KeyOrder:            c.KeyOrder,
			DeliveryLimit:       c.DeliveryLimit,
			BrokerDeliveryLimit: c.BrokerDeliveryLimit,
			HandlerTimeout:      c.HandlerTimeout,
			MaxBodyBytes:        c.MaxBodyBytes,
			DrainTimeout:        c.DrainTimeout,
			RetryBackoffMin:     c.RetryBackoff.Min,
			RetryBackoffMax:     c.RetryBackoff.Max,
			ReconnectBackoffMin: c.ReconnectBackoff.Min,
			ReconnectBackoffMax: c.ReconnectBackoff.Max,
			ConfirmTimeout:      c.ConfirmTimeout,
			StoreHold:           c.StoreHold,
			ClockSkew:           c.ClockSkew,
			Untimed:             string(c.Untimed),
			StartupTimeout:      c.StartupTimeout,
			KillSwitch:          !c.KillSwitch.Off,
			KillSwitchThreshold: c.KillSwitch.Threshold,
			KillSwitchRate:      c.KillSwitch.Rate,
			KillSwitchWindow:    c.KillSwitch.Window,
			KillSwitchProbeMin:  c.KillSwitch.Probe.Min,
			KillSwitchProbeMax:  c.KillSwitch.Probe.Max,
		},
		Redis: Redis{
			Enabled:                 true,
			Mode:                    "single",
			Prefix:                  r.Prefix,
			Lease:                   r.Lease,
			DoneTTL:                 r.DoneTTL,
			Timeout:                 r.Timeout,
			BreakerFailures:         r.Breaker.FailureThreshold,
			BreakerMinOutage:        r.Breaker.MinOutage,
			BreakerOpenTimeout:      r.Breaker.OpenTimeout,
			BreakerHalfOpenRequests: r.Breaker.HalfOpenRequests,
		},
		Postgres: Postgres{Retention: c.Retention},
		Outbox: Outbox{
			BatchSize:      o.BatchSize,
			PollInterval:   o.PollInterval,
			MaxAttempts:    o.MaxAttempts,
			BackoffMin:     o.BackoffMin,
			BackoffMax:     o.BackoffMax,
			PublishTimeout: o.PublishTimeout,
			Retention:      24 * time.Hour,
		},
	}
}

// The reference handlers (Handler; empty runs payments).
const (
	HandlerPayments = "payments"
	HandlerReceipts = "receipts"
)

// RelayConfig is the relay's part of c (the DB and the logger are the
// caller's).
func (c Config) RelayConfig() relay.Config {
	dests, _ := relay.ParseDestinations(c.Outbox.Destinations) // Validate parsed it
	for name, h := range c.Outbox.header {
		d := dests[name]
		d.Header = h.Clone()
		dests[name] = d
	}
	final, _ := parseFinalStatuses(c.Outbox.FinalStatuses) // Validate parsed it
	for name, codes := range final {
		d := dests[name]
		d.Final = codes
		dests[name] = d
	}
	return relay.Config{
		AMQPURLs:       broker.SplitURLs(c.AMQPURL),
		Destinations:   dests,
		BatchSize:      c.Outbox.BatchSize,
		PollInterval:   c.Outbox.PollInterval,
		MaxAttempts:    c.Outbox.MaxAttempts,
		BackoffMin:     c.Outbox.BackoffMin,
		BackoffMax:     c.Outbox.BackoffMax,
		PublishTimeout: c.Outbox.PublishTimeout,
		DoneStatus:     c.Outbox.DoneStatus,
		Retention:      c.Outbox.Retention,
	}
}

// ConsumerConfig is the consumer's part of c: the one mapping from the
// file's settings to the library's, which Default inverts.
func (c Config) ConsumerConfig() consumer.Config {
	return consumer.Config{
		URL:                 c.AMQPURL,
		Queue:               c.Queue,
		Partitions:          c.Partitions,
		Prefetch:            c.Consumer.Prefetch,
		Workers:             c.Consumer.Workers,
		BatchSize:           c.Consumer.BatchSize,
		BatchLinger:         c.Consumer.BatchLinger,
		KeyOrder:            c.Consumer.KeyOrder,
		DeliveryLimit:       c.Consumer.DeliveryLimit,
		BrokerDeliveryLimit: c.Consumer.BrokerDeliveryLimit,
		HandlerTimeout:      c.Consumer.HandlerTimeout,
		MaxBodyBytes:        c.Consumer.MaxBodyBytes,
		Retention:           c.Postgres.Retention,
		ClockSkew:           c.Consumer.ClockSkew,
		Untimed:             consumer.UntimedPolicy(c.Consumer.Untimed),
		StoreHold:           c.Consumer.StoreHold,
		StartupTimeout:      c.Consumer.StartupTimeout,
		RetryBackoff:        consumer.Backoff{Min: c.Consumer.RetryBackoffMin, Max: c.Consumer.RetryBackoffMax},
		ReconnectBackoff:    consumer.Backoff{Min: c.Consumer.ReconnectBackoffMin, Max: c.Consumer.ReconnectBackoffMax},
		DrainTimeout:        c.Consumer.DrainTimeout,
		ConfirmTimeout:      c.Consumer.ConfirmTimeout,
		KillSwitch: consumer.KillSwitch{
			Threshold: c.Consumer.KillSwitchThreshold,
			Rate:      c.Consumer.KillSwitchRate,
			Window:    c.Consumer.KillSwitchWindow,
			Probe:     consumer.Backoff{Min: c.Consumer.KillSwitchProbeMin, Max: c.Consumer.KillSwitchProbeMax},
			Off:       !c.Consumer.KillSwitch,
		},
	}
}

// FastConfig is the fast tier's part of c.
func (c Config) FastConfig() redistier.Config {
	return redistier.Config{
		Prefix:  c.Redis.Prefix,
		Lease:   c.Redis.Lease,
		DoneTTL: c.Redis.DoneTTL,
		Timeout: c.Redis.Timeout,
		Breaker: redistier.BreakerConfig{
			FailureThreshold: c.Redis.BreakerFailures,
			MinOutage:        c.Redis.BreakerMinOutage,
			OpenTimeout:      c.Redis.BreakerOpenTimeout,
			HalfOpenRequests: c.Redis.BreakerHalfOpenRequests,
		},
	}
}

// Load returns the defaults overlaid with the YAML file at path (if path is
// not empty) and then with the environment (environ, as os.Environ returns
// it), validated; outbox.headers' values are read from environ too. An IDEM_*
// variable that names no setting is an error, like an unknown YAML key. Risky
// but legal settings are listed by Warnings, for the caller to log once.
func Load(path string, environ []string) (Config, error) {
	cfg := Default()
	cfg.Consumer.BatchSize = 0 // unless set: 256, or prefetch if lower
	if path != "" {
		b, err := os.ReadFile(path)
		if err != nil {
			return cfg, fmt.Errorf("config: %w", err)
		}
		if err := applyYAML(&cfg, b); err != nil {
			return cfg, fmt.Errorf("config %s: %w", path, err)
		}
	}
	if err := applyEnv(&cfg, environ); err != nil {
		return cfg, err
	}
	if cfg.Consumer.BatchSize == 0 {
		cfg.Consumer.BatchSize = min(Default().Consumer.BatchSize, cfg.Consumer.Prefetch)
	}
	if cfg.Postgres.MaxConns == 0 {
		cfg.Postgres.MaxConns = int32(cfg.Consumer.Workers + 4)
	}
	if err := cfg.Validate(); err != nil {
		return cfg, err
	}
	header, err := readHeaders(cfg.Outbox.Headers, environ)
	if err != nil {
		return cfg, err
	}
	cfg.Outbox.header = header
	return cfg, nil
}

// DatabaseURLs returns the shards' URLs in order, or database_url alone.
func (c Config) DatabaseURLs() []string {
	if urls := strings.Fields(c.Postgres.Shards); len(urls) > 0 {
		return urls
	}
	return []string{c.DatabaseURL}
}

// Topology is the queues and dead-letter queue the settings name.
func (c Config) Topology() broker.Topology {
	t := broker.TopologyFor(c.Queue, c.Consumer.BrokerDeliveryLimit)
	t.Partitions = c.Partitions
	return t
}
