package idem

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/internal/redact"
	"github.com/idemhq/idem/migrations"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/redistier"
	"github.com/idemhq/idem/pkg/outbox"
)

// Config configures a Service. Scope, a database, Consumer.URL and
// Consumer.Queue are required; everything else has a safe default.
type Config struct {
	// Scope namespaces event IDs in Redis and Postgres: the consuming
	// service's name. Required.
	Scope string
	// DatabaseURL is the PostgreSQL URL (or DSN) the service opens a pool
	// on, sized Consumer.Workers + 4 unless the URL sets pool_max_conns.
	// Its sessions are bounded on both ends (TCP keepalives and user
	// timeout; idle_in_transaction_session_timeout, statement_timeout and
	// lock_timeout from Consumer.HandlerTimeout), unless the URL sets them.
	// Set it or Databases.
	DatabaseURL string
	// Databases are pools the service already has, in shard order: one,
	// or one per shard of the authoritative tier (see guard.Config.Shards).
	// Each should allow more connections than Consumer.Workers (a warning
	// is logged otherwise: batches would wait for a connection, within
	// their HandlerTimeout). The service does not close them, nor bound
	// their sessions: set idle_in_transaction_session_timeout and
	// lock_timeout on them (docs/operations.md), or a session orphaned by
	// a half-open connection keeps its claimed rows locked.
	Databases []*pgxpool.Pool
	// Redis is the fast tier's client. Its options must let the context's
	// deadline bound each call (ContextTimeoutEnabled). The service does not
	// close it. Nil, with RedisURL empty, runs on Postgres alone: correct,
	// and slower on duplicates.
	Redis redis.UniversalClient
	// RedisURL, instead of Redis, is one Redis server's URL
	// (redis://host:6379/0); the service opens and closes the client. For
	// a cluster or Sentinel, pass a client. A database number the server
	// lacks stops Run at start (redistier.ErrNoSuchDatabase); a server that
	// is down does not.
	RedisURL string
	// RedisTLS, if set, is the TLS configuration of the client opened from
	// RedisURL, whose scheme then does not matter: the CAs to trust
	// (RootCAs), a client certificate (Certificates), the name the
	// server's certificate must carry (ServerName; empty: RedisURL's
	// host). A rediss:// URL without it trusts the system's CAs. For a
	// client passed as Redis, set its options' TLSConfig; for a cluster,
	// leave its ServerName empty, so that each node is verified against
	// its own address. Defaults to nil.
	RedisTLS *tls.Config
	// Fast tunes the fast tier (prefix, lease, done-marker TTL, timeout,
	// breaker). Fast.DoneTTL may not exceed Consumer.Retention, and
	// Fast.Timeout must be below Consumer.HandlerTimeout.
	Fast redistier.Config
	// Consumer is the queue and the runtime's tuning; URL and Queue are
	// required. Consumer.Retention and Consumer.ClockSkew are also what Run
	// records for the claim to enforce, and what pruning cuts by. Run sets
	// NotBefore and FormerPartitions from what the databases record.
	Consumer consumer.Config
	// Migrate applies the guard's migrations, then Migrations, at start.
	// Without it, Run checks that they were applied (by `idem migrate`,
	// say) and fails at once, naming the set, if one was not.
	Migrate bool
	// Migrations are the service's own sets (its effect tables), applied
	// after the guard's when Migrate is set, and checked when it is not.
	Migrations []migrations.Set
	// CheckReady, if set, is the service's own start-up check, called once
	// for each database (shard i of the list, with its pool) after the
	// migrations are applied or checked and before the consumer starts,
	// within Consumer.StartupTimeout: a query of each table and column the
	// handler needs, say. An error ends Run with it, naming the shard, so
	// that a broken deploy is never ready and takes no delivery; a
	// database that does not answer is waited for as for idem's own
	// checks.
	CheckReady func(ctx context.Context, shard int, db *pgxpool.Pool) error
	// HistoryWithout leaves parts of the database's history out of the
	// check that done markers in Redis pass (pgtier.Options.HistoryWithout:
	// pg_control_system, pg_walfile_name, pg_postmaster_start_time,
	// pg_relation_filenode), for a managed service that refuses those
	// functions to the runtime role. A weaker guarantee, taken knowingly:
	// an event the database lost in a way the part would have told (a
	// restore, a failover, ...), re-sent while Redis still holds its done
	// marker, is dropped as a duplicate. Run logs it as a warning. Empty
	// (the default) needs every function and refuses to start without one,
	// naming it and the GRANT.
	HistoryWithout []string
	// PruneInterval, if set, deletes dedup rows older than the retention
	// this often, from every shard, as `idem prune` does. Every
	// instance of a fleet may run it. Zero leaves pruning to `idem prune`.
	PruneInterval time.Duration
	// Heartbeat is how often the service reports itself in the first
	// database's idem_instance table (ready or why not, its kill switch,
	// its Redis breaker, its outcome counts and rates), for idem console.
	// Zero is every 5 s; negative reports nothing; else 100ms to 1m.
	Heartbeat time.Duration
	// Outbox declares where the handler's outbox messages go
	// (outbox.Enqueue) and tunes the relay Run runs beside the consumer to
	// publish them, one loop per database, stopped after the drain. With
	// Outbox.Destinations set, Enqueue refuses, inside the handler's
	// transaction, a message To any other name. Outbox.Databases must be
	// empty: the relay runs on the service's databases (their sessions
	// then allow a pass's transaction, Outbox.PublishTimeout and a
	// second). Outbox.AMQPURL defaults to Consumer.URL, Outbox.Metrics to
	// Metrics, Outbox.Logger to Logger, and Outbox.Name to
	// Consumer.ConnectionName and "-relay". Without Destinations: no relay
	// and no check.
	Outbox outbox.RelayConfig
	// NoRelay runs no relay in this service, whose outbox another process
	// publishes (an outbox.Relay, or idem relay): messages wait in
	// idem_outbox until it does. Enqueue still refuses a destination
	// Outbox.Destinations lacks.
	NoRelay bool
	// Metrics, if set, receives idem's Prometheus metrics (package
	// metrics), including the handler's own dead-letter reasons when it
	// lists them (a Reasons() []string method).
	Metrics prometheus.Registerer
	// Logger receives the service's logs. Defaults to slog.Default(). New
	// also routes the log lines of go-redis and amqp091 through it (a
	// failed dial, say): both libraries keep one logger per process, so the
	// last Service created wins.
	Logger *slog.Logger
}

// Limits that keep a Config safe.
const (
	minClockSkew     = time.Second
	minPruneInterval = time.Second
)

// validate checks what crosses the packages' own checks: the tiers must agree.
func (c *Config) validate() error {
	bad := func(format string, args ...any) error { return fmt.Errorf("idem: "+format, args...) }
	switch {
	case c.DatabaseURL == "" && len(c.Databases) == 0:
		return bad("DatabaseURL or Databases is required")
	case c.DatabaseURL != "" && len(c.Databases) > 0:
		return bad("set DatabaseURL or Databases, not both")
	case c.Redis != nil && c.RedisURL != "":
		return bad("set Redis or RedisURL, not both")
	case c.RedisTLS != nil && c.RedisURL == "":
		return bad("RedisTLS applies to the client opened from RedisURL; for a client passed as Redis, set its options' TLSConfig")
	case c.Consumer.ClockSkew < minClockSkew:
		return bad("Consumer.ClockSkew %s is below %s: the claim needs a skew to refuse events from the future", c.Consumer.ClockSkew, minClockSkew)
	case c.Consumer.Retention <= c.Consumer.ClockSkew:
		return bad("Consumer.Retention %s must exceed Consumer.ClockSkew %s", c.Consumer.Retention, c.Consumer.ClockSkew)
	case c.PruneInterval < 0 || (c.PruneInterval > 0 && c.PruneInterval < minPruneInterval):
		return bad("PruneInterval %s: want 0 (off) or at least %s", c.PruneInterval, minPruneInterval)
	case c.Heartbeat > 0 && (c.Heartbeat < 100*time.Millisecond || c.Heartbeat > time.Minute):
		return bad("Heartbeat %s: want 0 (every 5s), negative (off), or 100ms to 1m", c.Heartbeat)
	case len(c.Outbox.Databases) > 0:
		return bad("Outbox.Databases: leave it empty; the relay runs on the service's databases")
	}
	if err := guard.ValidateScope(c.Scope); err != nil {
		return bad("Scope: %w", err)
	}
	for i, p := range c.Databases {
		if p == nil {
			return bad("Databases[%d] is nil", i)
		}
	}
	if c.fastOn() {
		f := c.Fast
		switch {
		case f.DoneTTL > c.Consumer.Retention:
			return bad("Fast.DoneTTL %s exceeds Consumer.Retention %s: Redis would vouch for events Postgres has forgotten", f.DoneTTL, c.Consumer.Retention)
		case f.Timeout >= c.Consumer.HandlerTimeout:
			return bad("Fast.Timeout %s must be well below Consumer.HandlerTimeout %s: Redis is only an optimisation", f.Timeout, c.Consumer.HandlerTimeout)
		}
	}
	return nil
}

// fastOn reports whether the fast tier is configured.
func (c *Config) fastOn() bool { return c.Redis != nil || c.RedisURL != "" }

// redisOptions are the options a client opened from RedisURL gets: per-call
// deadlines from the context, no retries of its own (the breaker decides
// what a failure means), and no dial or read longer than a second.
// With tlsConfig (Config.RedisTLS), the client speaks TLS whatever the
// URL's scheme.
func redisOptions(url string, tlsConfig *tls.Config) (*redis.Options, error) {
	o, err := redis.ParseURL(url)
	if err != nil {
		return nil, fmt.Errorf("idem: RedisURL: %w", redact.Error(err, url))
	}
	if tlsConfig != nil {
		o.TLSConfig = tlsConfig.Clone() // an empty ServerName: crypto/tls takes the dialled host
	}
	o.ContextTimeoutEnabled, o.MaxRetries = true, -1
	o.DialTimeout, o.ReadTimeout, o.WriteTimeout = time.Second, time.Second, time.Second
	return o, nil
}
