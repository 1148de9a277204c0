package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/redact"
	"github.com/idemhq/idem/internal/relay"
)

// Defaults for RelayConfig that differ from the relay loop's own.
const (
	// defaultRetention keeps sent rows a day, for idem inspect.
	defaultRetention = 24 * time.Hour
	// startupTimeout bounds Run's wait for a database that is not up yet,
	// as consumer.Config.StartupTimeout's default does a consumer's.
	startupTimeout = 2 * time.Minute
	// maxBatchSize is the most rows a pass may claim.
	maxBatchSize = 4096
)

// RelayConfig configures a Relay. Databases and Destinations are required;
// the tuning has the defaults of the idem relay command.
type RelayConfig struct {
	// Databases hold idem_outbox (migrations.Guard), in shard order: a
	// relay loop runs on each. A pass holds a transaction while it
	// publishes, up to PublishTimeout and a second: a pool's
	// idle_in_transaction_session_timeout and statement_timeout must
	// exceed that. The relay does not close them. The front door
	// (idem.Config.Outbox) runs on the service's own and refuses these.
	Databases []*pgxpool.Pool
	// AMQPURL is the broker's URL, or its nodes' URLs separated by
	// commas, as consumer.Config.URL. Required with a Queue or Exchange
	// destination; the front door defaults it to Consumer.URL.
	AMQPURL string
	// Destinations map the names messages are enqueued To (Message.To) to
	// where they go. A row To a name missing here goes dead at once, with
	// its reason, to be replayed (idem outbox replay) once it is here.
	Destinations map[string]Destination
	// Name is the client-provided name of the relay's RabbitMQ
	// connections, a shard's with "-shard<i>" added. Defaults to
	// idem-relay-<host>-<pid>; the front door's to Consumer.ConnectionName and
	// "-relay".
	Name string
	// BatchSize is the most rows one pass claims, 1 to 4096. Defaults to
	// 500.
	BatchSize int
	// PollInterval is how often an idle relay looks for rows without a
	// notification (LISTEN is only a hint). Defaults to 1s.
	PollInterval time.Duration
	// MaxAttempts is how many failed publishes (each answered by the
	// destination; an outage spends none) make a row dead. Defaults to 20.
	MaxAttempts int
	// BackoffMin and BackoffMax bound the wait before a failed row is
	// tried again, doubling per attempt, jittered. Default to 1s and 5m.
	BackoffMin, BackoffMax time.Duration
	// PublishTimeout bounds a pass's wait for the broker's confirms, and
	// one HTTP request. Defaults to 10s.
	PublishTimeout time.Duration
	// DoneStatus, if set, is an HTTP status an API answers for a key whose
	// request it already completed, counted as sent like a 2xx; never one
	// it answers while that key is still in progress (Stripe's 409).
	DoneStatus int
	// Retention is how long sent rows are kept, for idem inspect.
	// Defaults to 24h; negative deletes a row once it is sent.
	Retention time.Duration
	// Metrics, if set, receives the relay's Prometheus metrics
	// (idem_outbox_*); the front door defaults it to Config.Metrics.
	Metrics prometheus.Registerer
	// Logger receives the relay's logs. Defaults to slog.Default(); the
	// front door's to Config.Logger.
	Logger *slog.Logger
}

// validate checks what the relay loop's own checks do not name as a field.
func (c *RelayConfig) validate() error {
	bad := func(format string, args ...any) error { return fmt.Errorf("outbox: "+format, args...) }
	switch {
	case len(c.Databases) == 0:
		return bad("Databases is required")
	case c.BatchSize < 0 || c.BatchSize > maxBatchSize:
		return bad("BatchSize %d: want 1 to %d (0: the default)", c.BatchSize, maxBatchSize)
	case c.PollInterval < 0:
		return bad("PollInterval %s must not be negative", c.PollInterval)
	case c.MaxAttempts < 0:
		return bad("MaxAttempts %d must not be negative", c.MaxAttempts)
	case c.BackoffMin < 0 || c.BackoffMax < 0:
		return bad("BackoffMin %s and BackoffMax %s must not be negative", c.BackoffMin, c.BackoffMax)
	case c.PublishTimeout < 0:
		return bad("PublishTimeout %s must not be negative", c.PublishTimeout)
	case c.DoneStatus != 0 && (c.DoneStatus < 100 || c.DoneStatus > 599):
		return bad("DoneStatus %d is not an HTTP status", c.DoneStatus)
	}
	for i, p := range c.Databases {
		if p == nil {
			return bad("Databases[%d] is nil", i)
		}
	}
	for _, u := range broker.SplitURLs(c.AMQPURL) {
		if _, err := amqp.ParseURI(u); err != nil {
			return bad("AMQPURL: %w", redact.Error(err, u))
		}
	}
	return nil
}

// loopConfig is the relay loop's configuration for c's destinations.
func (c *RelayConfig) loopConfig(dests map[string]relay.Destination, m *relay.Metrics) relay.Config {
	rc := relay.Config{
		AMQPURLs:       broker.SplitURLs(c.AMQPURL),
		Destinations:   dests,
		Name:           c.Name,
		BatchSize:      c.BatchSize,
		PollInterval:   c.PollInterval,
		MaxAttempts:    c.MaxAttempts,
		BackoffMin:     c.BackoffMin,
		BackoffMax:     c.BackoffMax,
		PublishTimeout: c.PublishTimeout,
		DoneStatus:     c.DoneStatus,
		Retention:      max(c.Retention, 0),
		Metrics:        m,
		Logger:         c.Logger,
	}
	if c.Retention == 0 {
		rc.Retention = defaultRetention
	}
	return rc
}

// Relay publishes the outbox of one or more databases to their
// destinations, as the idem relay command does: run as many as you like,
// anywhere; they share the work, and a key's messages leave in order.
// Create it with NewRelay and run it with Run; Ready is safe to call at
// any time.
type Relay struct {
	dbs   []*pgxpool.Pool
	dests map[string]relay.Destination
	loops []*relay.Relay
	log   *slog.Logger
}

// NewRelay checks cfg and returns a Relay. It opens no connection; it
// registers the metrics on cfg.Metrics.
func NewRelay(cfg RelayConfig) (*Relay, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	dests, err := relayedAll(cfg.Destinations)
	if err != nil {
		return nil, err
	}
	for _, name := range relay.Names(dests) {
		if dests[name].Kind != relay.HTTP && cfg.AMQPURL == "" {
			return nil, fmt.Errorf("outbox: destination %q: AMQPURL is required for a Queue or Exchange destination", name)
		}
	}
	var m *relay.Metrics
	if cfg.Metrics != nil {
		if m, err = relay.NewMetrics(cfg.Metrics, relay.Names(dests)); err != nil {
			return nil, fmt.Errorf("outbox: Metrics: %w", err)
		}
	}
	r := &Relay{dbs: cfg.Databases, dests: dests, log: cfg.Logger}
	loops, err := relay.PerShard(cfg.loopConfig(dests, m), cfg.Databases)
	if err != nil {
		return nil, fmt.Errorf("outbox: %w", err)
	}
	r.loops = loops
	return r, nil
}

// Run relays until ctx ends, then returns nil once every pass in progress
// has ended (within PublishTimeout and a second; a request hook that
// ignores its request's context is left running) and its connections are
// closed. At the start it checks each queue destination's Partitions
// against the count each database records for its stream, waiting up to
// two minutes for a database that is not up yet; it returns a mismatch, or
// a database that stayed away, as its error. Call it once.
func (r *Relay) Run(ctx context.Context) error {
	for i, db := range r.dbs {
		on := ""
		if len(r.dbs) > 1 {
			on = fmt.Sprintf("on shard %d", i)
		}
		if err := relay.AwaitPartitions(ctx, db, r.dests, startupTimeout, on, r.log); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("outbox: %w", err)
		}
	}
	r.log.Info("relaying", "destinations", relay.Names(r.dests), "shards", len(r.dbs))
	relay.RunAll(ctx, r.loops)
	return nil
}

// Ready returns nil while the relay works: each database's last pass
// reached it, its last pass with rows reached their destinations, and the
// broker has not refused the relay's connection lately. Otherwise (not
// started yet, unreachable, a request hook failing, every publish refused)
// it says why.
func (r *Relay) Ready() error {
	var errs []error
	for i, loop := range r.loops {
		if err := loop.Ready(); err != nil {
			if len(r.loops) > 1 {
				err = fmt.Errorf("shard %d: %w", i, err)
			}
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
