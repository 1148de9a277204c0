package consumer

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/redact"
)

// Defaults for Config, which WithDefaults fills in.
const (
	defaultConnectionName      = "idem-consumer"
	defaultPrefetch            = 1024
	defaultWorkers             = 2
	defaultBatchSize           = 256
	defaultBatchLinger         = 5 * time.Millisecond
	defaultDeliveryLimit       = 5
	defaultBrokerDeliveryLimit = broker.DefaultDeliveryLimit
	defaultHandlerTimeout      = 10 * time.Second
	defaultDrainTimeout        = 30 * time.Second
	defaultConfirmTimeout      = 10 * time.Second
	defaultStoreHold           = time.Minute
	defaultClockSkew           = 5 * time.Minute
	defaultStartupTimeout      = 2 * time.Minute
	defaultRetention           = 30 * 24 * time.Hour
	defaultMaxBodyBytes        = 1 << 20
	// minMaxBodyBytes is the least MaxBodyBytes: below it, ordinary events
	// would be refused.
	minMaxBodyBytes = 1 << 10
	// maxLetterBody bounds the part of a refused body (body_too_large) its
	// dead letter carries: enough to identify it, never the whole of it.
	maxLetterBody = 64 << 10
)

// UntimedPolicy says what the consumer does with an event that carries no
// time (no guard.Event.Time from Decode, no AMQP timestamp).
type UntimedPolicy string

const (
	// UntimedAuto lets it through to the store while no dedup row was ever
	// pruned, when its row, if any, is certainly still there; once a prune
	// has cut, the store refuses it ("missing_time") unless its row
	// exists. It can never be applied twice. The default.
	UntimedAuto UntimedPolicy = "auto"
	// UntimedReject dead-letters it as "missing_time" at once, for an
	// operator who wants to learn from the first message that a producer
	// stopped stamping its events.
	UntimedReject UntimedPolicy = "reject"
)

// Default backoffs for Config.
var (
	defaultRetryBackoff     = Backoff{Min: 200 * time.Millisecond, Max: 10 * time.Second}
	defaultReconnectBackoff = Backoff{Min: 100 * time.Millisecond, Max: 10 * time.Second}
)

// Config configures a Consumer.
type Config struct {
	// URL is the AMQP URL, e.g. amqp://guest:guest@127.0.0.1:5672/, or
	// the URLs of a cluster's nodes separated by commas: each session
	// connects to the first that answers, starting after the node of the
	// session before, so a consumer that loses its node moves to another.
	// Required.
	URL string
	// Queue is the queue to consume (with Partitions, the name its
	// partition queues share). Required.
	Queue string
	// Partitions is how many partition queues the stream is split over:
	// <Queue>.0 to <Queue>.<n-1>, an event in the queue of
	// partition.Of(its shard key, n), every partition sharing the one
	// dead-letter queue <Queue>.dlq. 0 or 1: one queue, named Queue.
	Partitions int
	// Only lists the partitions this consumer takes (0 to Partitions-1);
	// empty takes them all.
	Only []int
	// FormerPartitions is the stream's partition count before its last
	// change (recorded in idem_stream), 0 if it never changed. The
	// consumer watches the queues of the stream that its layout lacks
	// (Queue itself while partitioned, the former count's extra
	// partitions, and, for a publisher outside idem that routes by a
	// larger count, the partitions from Partitions up to
	// max(2×Partitions, Partitions+8), below 1024) and reports any message
	// stranded there (Stats, logs).
	FormerPartitions int
	// ConnectionName is the client-provided connection name shown by the
	// broker. Defaults to "idem-consumer".
	ConnectionName string
	// Prefetch is the most unacked deliveries the broker sends this
	// process. It counts messages, not bytes: the deliveries it holds are
	// bounded by Prefetch × the broker's max_message_size (MaxBodyBytes is
	// checked on a body already in memory; docs/operations.md, "Message
	// size"). Defaults to 1024.
	Prefetch int
	// Workers is how many batches (with BatchSize 1, deliveries) this
	// process handles at once. Defaults to 2.
	Workers int
	// BatchSize is the most deliveries handled in one transaction: one
	// Redis pipeline claims them, one transaction claims their dedup rows
	// and applies them (see BatchHandler), and their acks go in as few
	// frames as is safe. 1 handles each delivery on its own. A batch never
	// holds more than Prefetch deliveries, and a BatchSize above Prefetch is
	// an error. Defaults to 256, or Prefetch if lower.
	BatchSize int
	// BatchLinger is how long a batch that is not full waits for more
	// deliveries before it goes while no other batch is in flight; while
	// one is, it waits up to three times as long, so that a free worker
	// takes a fuller batch. A batch goes at once when it fills. It bounds
	// the latency batching adds, but for an event set aside because
	// another consumer held its Redis lease: that one waits for the next
	// batch, up to 20 times as long while batches of this consumer are
	// being decided. Defaults to 5ms.
	BatchLinger time.Duration
	// KeyOrder applies the events of one key (guard.Event.ShardKey; every
	// event shares the empty key) in the order this consumer received them:
	// a batch waits for the batches before it that hold one of its keys,
	// events another consumer holds the lease on are not set aside, and a
	// failing event is retried in place, holding its key, rather than
	// handed back to the queue. An event that is handed back all the same
	// (held in place past StoreHold, or at shutdown) keeps its key held:
	// the key's events received after it go back to the queue too, in
	// order, until it comes back. For handlers where a refund must follow
	// its payment. It keeps delivery order only with one consumer per
	// partition (or queue), and a dead-lettered event is passed by the ones
	// after it.
	// Off by default: without it, Workers batches run at once and a later
	// batch may commit before an earlier one.
	KeyOrder bool
	// DeliveryLimit is how many deliveries a failing handler gets before
	// the message is dead-lettered as "handler_failed". Defaults to
	// 5.
	DeliveryLimit int
	// BrokerDeliveryLimit is the queues' x-delivery-limit, the broker's
	// backstop for a message that crashes every consumer that takes it.
	// At least DeliveryLimit. Defaults to 20 (or DeliveryLimit, if higher).
	BrokerDeliveryLimit int
	// HandlerTimeout bounds one attempt: claim, apply and commit.
	// Defaults to 10s.
	HandlerTimeout time.Duration
	// MaxBodyBytes is the longest body, in bytes, the handler's Decode is
	// given. A longer one is dead-lettered as "body_too_large" before it is
	// decoded, carrying its first min(MaxBodyBytes, 64 KiB) bytes and its
	// length (header x-idem-body-bytes); the kill switch does not count it.
	// The body is in memory by then: bound what the broker accepts with its
	// max_message_size (docs/operations.md). At least 1 KiB. Defaults to
	// 1 MiB.
	MaxBodyBytes int
	// Retention is how long dedup rows are kept. The consumer refuses
	// (dead-letters as beyond_retention) an event whose time is that old or
	// older when it is decoded, before it costs a claim: its dedup row may
	// have been pruned. The event's time
	// is guard.Event.Time from Decode (the producer's payload), else the
	// AMQP timestamp; never this consumer's clock or a header. Set it to the
	// store's retention. The store checks the horizon again, by the values
	// it records, when it claims the row (see pgtier.Store.Claim); that
	// check, not this one, is what keeps a held or replayed event from
	// being applied twice. Defaults to 720h (30 days).
	Retention time.Duration
	// NotBefore, if set, refuses events older than it as
	// "beyond_retention" too: the store's rows before it were pruned. The
	// front door (package idem) sets it from what the store records.
	NotBefore time.Time
	// ClockSkew is how far in the future an event's time may be before it
	// is refused as "future_timestamp" (a future time would keep a
	// replay inside the horizon forever), in the early check. The front
	// door (package idem) records the same value in the store, which
	// enforces the largest one recorded when it claims. Defaults to 5m.
	ClockSkew time.Duration
	// Untimed is what happens to an event with no time. Defaults to
	// UntimedAuto.
	Untimed UntimedPolicy
	// StoreHold bounds how long a delivery is held and retried in place
	// while Postgres is unreachable; after it the delivery goes back to the
	// queue ("store_unavailable"). Keep it well under RabbitMQ's
	// consumer_timeout. Defaults to 1m.
	StoreHold time.Duration
	// RetryBackoff spaces a failing handler's attempts, and in-place retries
	// while Postgres is unreachable. Defaults to 200ms to 10s.
	RetryBackoff Backoff
	// ReconnectBackoff spaces reconnection attempts to RabbitMQ.
	// Defaults to 100ms to 10s.
	ReconnectBackoff Backoff
	// DrainTimeout is how long in-flight work may run after shutdown
	// begins before it is rolled back. Defaults to 30s.
	DrainTimeout time.Duration
	// StartupTimeout bounds how long Run retries before its first session
	// consumes; after it Run returns the last error. Later outages are
	// retried for as long as they last. Defaults to 2m.
	StartupTimeout time.Duration
	// ConfirmTimeout bounds the wait for a dead-letter publisher confirm.
	// Defaults to 10s.
	ConfirmTimeout time.Duration
	// KillSwitch stops the consumer when distinct events fail the same way
	// (a broken deploy), instead of dead-lettering the stream; see
	// KillSwitch for what counts and what the defaults are. On by default.
	KillSwitch KillSwitch
	// Observer, if set, sees each delivery's end, the Counter* events and
	// the batches gathered. For metrics and tracing.
	Observer Observer
	// Logger receives the consumer's logs. Defaults to slog.Default().
	Logger *slog.Logger
}

// WithDefaults returns c with every unset field at its default: the values a
// Consumer runs with, and the ones idem's own configuration starts from.
func (c Config) WithDefaults() Config {
	c.setDefaults()
	return c
}

func (c *Config) setDefaults() {
	if c.ConnectionName == "" {
		c.ConnectionName = defaultConnectionName
	}
	if c.Prefetch == 0 {
		c.Prefetch = defaultPrefetch
	}
	if c.Workers == 0 {
		c.Workers = defaultWorkers
	}
	if c.BatchSize == 0 {
		c.BatchSize = min(defaultBatchSize, c.Prefetch)
	}
	if c.BatchLinger == 0 {
		c.BatchLinger = defaultBatchLinger
	}
	if c.DeliveryLimit == 0 {
		c.DeliveryLimit = 5
	}
	if c.BrokerDeliveryLimit == 0 {
		c.BrokerDeliveryLimit = max(defaultBrokerDeliveryLimit, c.DeliveryLimit)
	}
	if c.HandlerTimeout == 0 {
		c.HandlerTimeout = defaultHandlerTimeout
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = defaultMaxBodyBytes
	}
	if c.RetryBackoff == (Backoff{}) {
		c.RetryBackoff = defaultRetryBackoff
	}
	if c.ReconnectBackoff == (Backoff{}) {
		c.ReconnectBackoff = defaultReconnectBackoff
	}
	if c.DrainTimeout == 0 {
		c.DrainTimeout = defaultDrainTimeout
	}
	if c.ConfirmTimeout == 0 {
		c.ConfirmTimeout = defaultConfirmTimeout
	}
	if c.StartupTimeout == 0 {
		c.StartupTimeout = defaultStartupTimeout
	}
	if c.StoreHold == 0 {
		c.StoreHold = defaultStoreHold
	}
	if c.Retention == 0 {
		c.Retention = defaultRetention
	}
	if c.ClockSkew == 0 {
		c.ClockSkew = defaultClockSkew
	}
	if c.Untimed == "" {
		c.Untimed = UntimedAuto
	}
	c.KillSwitch.setDefaults()
	if c.Observer == nil {
		c.Observer = nopObserver{}
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

func (c *Config) validate() error {
	var uriErr error
	for _, u := range broker.SplitURLs(c.URL) {
		if _, err := amqp.ParseURI(u); err != nil && uriErr == nil {
			uriErr = err
		}
	}
	for _, p := range c.Only {
		if p < 0 || p >= max(c.Partitions, 1) {
			return fmt.Errorf("consumer: Only: partition %d is not one of 0 to %d", p, max(c.Partitions, 1)-1)
		}
	}
	switch {
	case len(broker.SplitURLs(c.URL)) == 0:
		return errors.New("consumer: URL is required")
	case uriErr != nil:
		return fmt.Errorf("consumer: URL: %w", redact.Error(uriErr, c.URL))
	case c.Partitions < 0:
		return fmt.Errorf("consumer: Partitions must not be negative, got %d", c.Partitions)
	case c.StartupTimeout <= 0:
		return fmt.Errorf("consumer: StartupTimeout must be positive, got %s", c.StartupTimeout)
	case c.Queue == "":
		return errors.New("consumer: Queue is required")
	case c.Prefetch < 1:
		return fmt.Errorf("consumer: Prefetch must be at least 1, got %d", c.Prefetch)
	case c.Workers < 1:
		return fmt.Errorf("consumer: Workers must be at least 1, got %d", c.Workers)
	case c.BatchSize < 1:
		return fmt.Errorf("consumer: BatchSize must be at least 1, got %d", c.BatchSize)
	case c.BatchSize > c.Prefetch:
		return fmt.Errorf("consumer: BatchSize (%d) must not exceed Prefetch (%d): a batch is gathered from the unacked deliveries", c.BatchSize, c.Prefetch)
	case c.BatchLinger < 0:
		return fmt.Errorf("consumer: BatchLinger must not be negative, got %s", c.BatchLinger)
	case c.DeliveryLimit < 1:
		return fmt.Errorf("consumer: DeliveryLimit must be at least 1, got %d", c.DeliveryLimit)
	case c.BrokerDeliveryLimit < c.DeliveryLimit:
		return fmt.Errorf("consumer: BrokerDeliveryLimit (%d) must be at least DeliveryLimit (%d)", c.BrokerDeliveryLimit, c.DeliveryLimit)
	case c.HandlerTimeout <= 0:
		return fmt.Errorf("consumer: HandlerTimeout must be positive, got %s", c.HandlerTimeout)
	case c.MaxBodyBytes < minMaxBodyBytes:
		return fmt.Errorf("consumer: MaxBodyBytes must be at least %d, got %d", minMaxBodyBytes, c.MaxBodyBytes)
	case c.Retention < 0:
		return fmt.Errorf("consumer: Retention must be positive, got %s", c.Retention)
	case c.DrainTimeout <= 0:
		return fmt.Errorf("consumer: DrainTimeout must be positive, got %s", c.DrainTimeout)
	case c.ConfirmTimeout <= 0:
		return fmt.Errorf("consumer: ConfirmTimeout must be positive, got %s", c.ConfirmTimeout)
	case c.StoreHold <= 0:
		return fmt.Errorf("consumer: StoreHold must be positive, got %s", c.StoreHold)
	case c.ClockSkew < 0:
		return fmt.Errorf("consumer: ClockSkew must not be negative, got %s", c.ClockSkew)
	case c.Untimed != UntimedAuto && c.Untimed != UntimedReject:
		return fmt.Errorf("consumer: Untimed must be %q or %q, got %q", UntimedAuto, UntimedReject, c.Untimed)
	case c.Prefetch > 65535:
		return fmt.Errorf("consumer: Prefetch must be at most 65535 (AMQP sends it as 16 bits), got %d", c.Prefetch)
	}
	if err := c.KillSwitch.validate(); err != nil {
		return err
	}
	backoffs := map[string]Backoff{"RetryBackoff": c.RetryBackoff, "ReconnectBackoff": c.ReconnectBackoff}
	if !c.KillSwitch.Off {
		backoffs["KillSwitch.Probe"] = c.KillSwitch.Probe
	}
	for name, b := range backoffs {
		if b.Min <= 0 || b.Max < b.Min {
			return fmt.Errorf("consumer: %s: want 0 < Min <= Max, got Min=%s Max=%s", name, b.Min, b.Max)
		}
	}
	return nil
}
