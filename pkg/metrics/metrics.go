// Package metrics reports what the guard and the consumer do as Prometheus
// metrics. A Metrics is both a guard.Observer and a consumer.Observer:
//
//	reg := prometheus.NewRegistry()
//	m, err := metrics.New(reg)
//	g, err := guard.New(guard.Config{..., Observer: m})
//	c, err := consumer.New(consumer.Config{..., Observer: m}, g, h)
//	m.WatchConsumer(c.Stats)
//
// Every metric is named idem_*; docs/operations.md lists them and says which
// to alert on.
package metrics

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemhq/idem/internal/redisfault"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
)

var (
	_ guard.Observer    = (*Metrics)(nil)
	_ consumer.Observer = (*Metrics)(nil)
)

// Metrics holds idem's Prometheus metrics. Its methods are safe for
// concurrent use.
type Metrics struct {
	reg prometheus.Registerer

	deliveries  *prometheus.CounterVec
	acked       map[guard.Outcome]prometheus.Counter // deliveries{outcome, reason=""}
	deadLetters *prometheus.CounterVec
	eventAge    prometheus.Histogram
	stages      map[guard.Stage]prometheus.Observer
	batchSize   prometheus.Histogram
	counters    map[string]prometheus.Counter
	redisErrors *prometheus.CounterVec
	pgErrors    *prometheus.CounterVec
	transitions *prometheus.CounterVec
	state       *prometheus.GaugeVec
	open        prometheus.Gauge
	pruned      prometheus.Counter
	crossShard  prometheus.Counter
}

// Breaker states, as redistier.Filter.BreakerState names them.
var breakerStates = []string{"closed", "half-open", "open"}

// New registers idem's metrics on reg and returns them. Every series that
// can be known in advance starts at zero, so that rate() and alerts see it
// before its first event.
func New(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		reg: reg,
		deliveries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_deliveries_total",
			Help: "Deliveries by outcome (processed, duplicate_redis, duplicate_postgres, duplicate_batch, payload_conflict, retry, dead_lettered) and reason. Each delivery is counted once; a payload conflict is dead-lettered and counted as outcome=payload_conflict.",
		}, []string{"outcome", "reason"}),
		deadLetters: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_dead_letters_total",
			Help: "Messages moved to the dead-letter queue (publish confirmed), by reason, payload conflicts included.",
		}, []string{"reason"}),
		eventAge: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "idem_event_age_seconds",
			Help:    "Age of an event when its delivery was acked (processed or duplicate): from the producer's time (payload occurredAt, else the AMQP timestamp) to the ack.",
			Buckets: prometheus.ExponentialBuckets(0.005, 3, 13), // 5ms to 44m
		}),
		batchSize: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "idem_batch_size",
			Help:    "Deliveries per gathered batch.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 11), // 1 to 1024
		}),
		redisErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_redis_errors_total",
			Help: "Fast-tier calls that failed, by operation (fast_claim, mark_done, release) and kind (breaker_open, timeout, connection, server, canceled, other). None fails an event.",
		}, []string{"op", "kind"}),
		pgErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_postgres_errors_total",
			Help: "Failed store stages (history, store_claim, commit), whatever the cause; the consumer retries, holds or dead-letters as the error asks.",
		}, []string{"stage"}),
		transitions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_breaker_transitions_total",
			Help: "Redis circuit breaker transitions.",
		}, []string{"from", "to"}),
		state: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "idem_breaker_state",
			Help: "Redis circuit breaker state: 1 for the current state (closed, half-open, open), 0 for the others.",
		}, []string{"state"}),
		open: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "idem_breaker_open",
			Help: "Whether the Redis circuit breaker is open (1) or not (0).",
		}),
		pruned: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "idem_retention_rows_pruned_total",
			Help: "Dedup rows deleted by retention (postgres.prune_interval).",
		}),
		crossShard: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "idem_cross_shard_conflicts_total",
			Help: "Events processed although Redis knew their ID as processed with another payload: a payload conflict between shards (or with a pruned row) that the store cannot see. Counts only what Redis still remembers.",
		}),
	}
	stages := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "idem_stage_duration_seconds",
		Help:    "How long one run of a guard stage took, for a whole batch: fast_claim (Redis pipeline), history (the database's history, read alone to confirm done markers), store_claim (BEGIN and the dedup rows' claim), apply (the handler), commit, mark_done, release.",
		Buckets: prometheus.ExponentialBuckets(0.0001, 2.5, 12), // 0.1ms to 6s
	}, []string{"stage"})
	collectors := []prometheus.Collector{m.deliveries, m.deadLetters, m.eventAge, m.batchSize, m.redisErrors,
		m.pgErrors, m.transitions, m.state, m.open, m.pruned, m.crossShard, stages}

	m.acked = map[guard.Outcome]prometheus.Counter{}
	for _, o := range guard.Outcomes() {
		m.acked[o] = m.deliveries.WithLabelValues(o.String(), "")
	}
	// The series alerts read start at 0, so that increase() sees the first
	// conflict or dead letter after a restart (a series born at 1 has no
	// increase).
	m.deliveries.WithLabelValues(guard.OutcomePayloadConflict.String(), wire.ReasonPayloadConflict)
	m.AddReasons(wire.Reasons()...)
	m.stages = map[guard.Stage]prometheus.Observer{}
	for _, s := range guard.Stages() {
		m.stages[s] = stages.WithLabelValues(string(s))
	}
	for _, op := range []guard.Stage{guard.StageFastClaim, guard.StageMarkDone, guard.StageRelease} {
		for _, kind := range redisfault.Kinds() {
			m.redisErrors.WithLabelValues(string(op), kind)
		}
	}
	for _, s := range []guard.Stage{guard.StageHistory, guard.StageStoreClaim, guard.StageCommit} {
		m.pgErrors.WithLabelValues(string(s))
	}
	m.counters = map[string]prometheus.Counter{}
	for _, name := range wire.Counters() {
		c := prometheus.NewCounter(prometheus.CounterOpts{Name: "idem_" + name + "_total", Help: counterHelp[name]})
		m.counters[name] = c
		collectors = append(collectors, c)
	}
	m.setState("closed")

	for _, c := range collectors {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("metrics: %w", err)
		}
	}
	return m, nil
}

var counterHelp = map[string]string{
	wire.CounterStoreRetry:         "Attempts retried in place because Postgres was unreachable (the delivery held, its budget untouched).",
	wire.CounterUntimedAccepted:    "Events without a time let through to the store (consumer.untimed: auto); it refuses them once rows were pruned.",
	wire.CounterBatchSplit:         "Batches split in two because their transaction failed for a reason that may be one event's.",
	wire.CounterDeferred:           "Batches that set events aside for a moment because another consumer held their Redis lease.",
	wire.CounterReconnect:          "Reconnections to RabbitMQ after a session ended or a dial failed.",
	wire.CounterDeadLetterReturned: "Dead letters the broker returned unroutable (dead-letter queue missing); each was requeued and the queue re-declared.",
	wire.CounterPublishBlocked:     "Times RabbitMQ blocked the consumer's publishing connection (a memory or disk alarm); dead letters wait meanwhile, acks go on.",
	wire.CounterKillSwitchTrips:    "Times the consumer's kill switch tripped: distinct events failed the same way (a broken deploy), so it stopped taking deliveries and handed back what it held; idem_kill_switch_open says whether it is open now.",
	wire.CounterBrokerRefused:      "Sessions RabbitMQ refused (403 access refused, 530 not allowed) or dropped during the handshake, which amqp091 reports alike; each is retried. Lasting: the credentials, vhost, permissions or a connection limit; passing: a broker restarting or a network fault.",
}

// AddReasons starts the dead-letter series of reasons at 0: the runtime's
// are started by New; a handler adds the ones it passes to
// consumer.Reject, so that an alert sees the first dead letter of each.
func (m *Metrics) AddReasons(reasons ...string) {
	for _, r := range reasons {
		m.deadLetters.WithLabelValues(r)
		m.deliveries.WithLabelValues(guard.OutcomeDeadLettered.String(), r)
	}
}

// ObserveStage implements guard.Observer.
func (m *Metrics) ObserveStage(_ context.Context, stage guard.Stage, _ int, took time.Duration, err error) {
	if o, ok := m.stages[stage]; ok {
		o.Observe(took.Seconds())
	}
	if err == nil {
		return
	}
	switch stage {
	case guard.StageFastClaim, guard.StageMarkDone, guard.StageRelease:
		m.redisErrors.WithLabelValues(string(stage), redisfault.Kind(err)).Inc()
	case guard.StageHistory, guard.StageStoreClaim, guard.StageCommit:
		if !errors.Is(err, context.Canceled) {
			m.pgErrors.WithLabelValues(string(stage)).Inc()
		}
	}
}

// Settled implements consumer.Observer.
func (m *Metrics) Settled(_ context.Context, s consumer.Settlement) {
	if c, ok := m.acked[s.Outcome]; ok && s.Reason == "" {
		c.Inc()
	} else {
		m.deliveries.WithLabelValues(s.Outcome.String(), s.Reason).Inc()
	}
	switch {
	case s.Outcome == guard.OutcomeDeadLettered, s.Outcome == guard.OutcomePayloadConflict:
		m.deadLetters.WithLabelValues(s.Reason).Inc()
	case s.Outcome == guard.OutcomeProcessed, s.Outcome.IsDuplicate():
		if !s.EventTime.IsZero() {
			m.eventAge.Observe(time.Since(s.EventTime).Seconds())
		}
	}
}

// Count implements consumer.Observer.
func (m *Metrics) Count(counter string, n int) {
	if c, ok := m.counters[counter]; ok {
		c.Add(float64(n))
	}
}

// Gathered implements consumer.Observer.
func (m *Metrics) Gathered(deliveries int) { m.batchSize.Observe(float64(deliveries)) }

// BreakerChanged records a Redis circuit breaker transition; pass it as
// redistier.BreakerConfig.OnStateChange.
func (m *Metrics) BreakerChanged(from, to string) {
	m.transitions.WithLabelValues(from, to).Inc()
	m.setState(to)
}

func (m *Metrics) setState(to string) {
	for _, s := range breakerStates {
		v := 0.0
		if s == to {
			v = 1
		}
		m.state.WithLabelValues(s).Set(v)
	}
	if to == "open" {
		m.open.Set(1)
	} else {
		m.open.Set(0)
	}
}

// Pruned counts dedup rows deleted by retention.
func (m *Metrics) Pruned(rows int64) { m.pruned.Add(float64(rows)) }

// CrossShardConflict implements guard.Observer.
func (m *Metrics) CrossShardConflict(context.Context, guard.Event) { m.crossShard.Inc() }

// WatchConsumer registers gauges read from stats at each scrape: whether the
// consumer is consuming, its deliveries in flight, its unacked deliveries,
// its prefetch, and whether its kill switch is open. Call it once per
// Metrics, with a Consumer's Stats.
func (m *Metrics) WatchConsumer(stats func() consumer.Stats) error {
	if err := m.reg.Register(killSwitchGauge{stats}); err != nil {
		return fmt.Errorf("metrics: %w", err)
	}
	gauges := []struct {
		name, help string
		value      func(consumer.Stats) float64
	}{
		{"idem_consuming", "Whether a session with RabbitMQ is consuming now (1) or not (0).", func(s consumer.Stats) float64 {
			if s.Consuming {
				return 1
			}
			return 0
		}},
		{"idem_deliveries_in_flight", "Deliveries received from the broker whose outcome is not reached yet.", func(s consumer.Stats) float64 { return float64(s.InFlight) }},
		{"idem_prefetch_in_use", "Unacked deliveries the broker counts against the prefetch: in flight, or settled and waiting for their ack frame.", func(s consumer.Stats) float64 { return float64(s.Unacked) }},
		{"idem_prefetch_limit", "The consumer's prefetch (consumer.prefetch).", func(s consumer.Stats) float64 { return float64(s.Prefetch) }},
		{"idem_stranded_messages", "Messages in queues of the stream that nobody consumes (a publisher using another partition count), as last checked.", func(s consumer.Stats) float64 { return float64(s.Stranded) }},
		{"idem_publish_blocked", "Whether RabbitMQ blocks the consumer's publishing connection now (1: a memory or disk alarm; dead letters wait) or not (0).", func(s consumer.Stats) float64 {
			if s.Blocked != "" {
				return 1
			}
			return 0
		}},
	}
	for _, g := range gauges {
		value := g.value
		c := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: g.name, Help: g.help}, func() float64 { return value(stats()) })
		if err := m.reg.Register(c); err != nil {
			return fmt.Errorf("metrics: %w", err)
		}
	}
	return nil
}

var killSwitchDesc = prometheus.NewDesc("idem_kill_switch_open",
	"Whether the consumer's kill switch is open (1: distinct events fail the same way, and it consumes nothing but probes) or not (0). class is the error class it tripped on (a SQLSTATE such as 42P01, or a reason such as handler_failed); empty while it is closed.",
	[]string{"class"}, nil)

// killSwitchGauge is idem_kill_switch_open, read from the consumer's Stats
// at each scrape: one series, labelled with the class while the switch is
// open, so that an alert names it.
type killSwitchGauge struct{ stats func() consumer.Stats }

func (g killSwitchGauge) Describe(ch chan<- *prometheus.Desc) { ch <- killSwitchDesc }

func (g killSwitchGauge) Collect(ch chan<- prometheus.Metric) {
	s := g.stats()
	v := 0.0
	if s.Tripped != "" {
		v = 1
	}
	ch <- prometheus.MustNewConstMetric(killSwitchDesc, prometheus.GaugeValue, v, s.TrippedOn)
}
