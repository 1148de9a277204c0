package relay

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the relay's Prometheus metrics. A nil *Metrics records
// nothing.
type Metrics struct {
	published *prometheus.CounterVec
	latency   *prometheus.HistogramVec
	pending   prometheus.Gauge
	oldest    prometheus.Gauge
	dead      prometheus.Gauge
	refusals  prometheus.Counter
	pausedG   *prometheus.GaugeVec
	pauses    *prometheus.CounterVec
}

// NewMetrics registers the relay's metrics on reg. Every destination's
// series start at zero.
func NewMetrics(reg prometheus.Registerer, destinations []string) (*Metrics, error) {
	m := &Metrics{
		published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_outbox_attempts_total",
			Help: "Outbox publish attempts by destination and result: sent (confirmed, or a 2xx), retry (failed, will be tried again), dead (failed for the last time).",
		}, []string{"destination", "result"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "idem_outbox_publish_latency_seconds",
			Help:    "From an outbox row's insert (its transaction's commit, near enough) to its publish's confirm.",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300},
		}, []string{"destination"}),
		pending: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "idem_outbox_pending_rows",
			Help: "Outbox rows not yet sent (counted up to a million).",
		}),
		oldest: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "idem_outbox_oldest_pending_seconds",
			Help: "Age of the oldest outbox row not yet sent; 0 when none is. The alert: a relay is down, stuck or failing.",
		}),
		dead: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "idem_outbox_dead_rows",
			Help: "Outbox rows that failed for good (idem outbox list --dead; idem outbox replay).",
		}),
		refusals: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "idem_outbox_broker_refusals_total",
			Help: "Relay connections RabbitMQ refused (403 access refused, 530 not allowed) or dropped during the handshake, which amqp091 reports alike; each pass tries again. Lasting: the credentials, vhost, permissions or a connection limit; passing: a broker restarting or a network fault.",
		}),
		pausedG: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "idem_outbox_destination_paused",
			Help: "The relay loops (one per shard) holding the destination paused: its rows failed alike (an HTTP 401, 403 or 5xx, no answer, unroutable, nacked), so they stay pending, spend no attempt, and one row probes on a backoff; idem outbox list shows why.",
		}, []string{"destination"}),
		pauses: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "idem_outbox_destination_pauses_total",
			Help: "Times a relay paused the destination (idem_outbox_destination_paused went to 1).",
		}, []string{"destination"}),
	}
	for _, c := range []prometheus.Collector{m.published, m.latency, m.pending, m.oldest, m.dead, m.refusals, m.pausedG, m.pauses} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	for _, d := range destinations {
		for _, r := range []string{"sent", "retry", "dead"} {
			m.published.WithLabelValues(d, r)
		}
		m.latency.WithLabelValues(d)
		m.pausedG.WithLabelValues(d)
		m.pauses.WithLabelValues(d)
	}
	return m, nil
}

func (m *Metrics) sent(destination string, latency time.Duration) {
	if m == nil {
		return
	}
	m.published.WithLabelValues(destination, "sent").Inc()
	m.latency.WithLabelValues(destination).Observe(latency.Seconds())
}

func (m *Metrics) failed(destination string, dead bool) {
	if m == nil {
		return
	}
	r := "retry"
	if dead {
		r = "dead"
	}
	m.published.WithLabelValues(destination, r).Inc()
}

// paused counts a relay loop's pause of a destination, or its resume:
// the loops of a process's shards share the gauge, which counts those
// holding the destination paused.
func (m *Metrics) paused(destination string, on bool) {
	if m == nil {
		return
	}
	if on {
		m.pauses.WithLabelValues(destination).Inc()
		m.pausedG.WithLabelValues(destination).Inc()
		return
	}
	m.pausedG.WithLabelValues(destination).Dec()
}

// refused counts a connection the broker refused or dropped during the
// handshake.
func (m *Metrics) refused() {
	if m == nil {
		return
	}
	m.refusals.Inc()
}

// watchEvery is how often the gauges are read from the table.
const watchEvery = 5 * time.Second

// watch keeps the gauges current until ctx ends.
func (m *Metrics) watch(ctx context.Context, db *pgxpool.Pool, log *slog.Logger) {
	for {
		s, err := ReadBacklog(ctx, db)
		if err == nil {
			m.pending.Set(float64(s.Pending))
			m.oldest.Set(s.Oldest.Seconds())
			m.dead.Set(float64(s.Dead))
		} else if ctx.Err() == nil {
			log.Debug("read outbox backlog", "err", err)
		}
		sleep(ctx, watchEvery)
		if ctx.Err() != nil {
			return
		}
	}
}

// Backlog is the outbox's unsent rows.
type Backlog struct {
	Pending int64         // counted up to a million
	Oldest  time.Duration // age of the oldest pending row; 0 if none
	Dead    int64
}

// ReadBacklog reads the backlog through the partial indexes, in one round
// trip.
func ReadBacklog(ctx context.Context, db queryer) (Backlog, error) {
	var s Backlog
	var oldestMicros *int64
	b := &pgx.Batch{}
	b.Queue(`SELECT count(*) FROM (SELECT 1 FROM idem_outbox WHERE state = 'pending' LIMIT 1000000) p`).QueryRow(func(r pgx.Row) error { return r.Scan(&s.Pending) })
	b.Queue(`SELECT (extract(epoch FROM clock_timestamp() - created_at) * 1e6)::bigint FROM idem_outbox WHERE state = 'pending' ORDER BY id LIMIT 1`).QueryRow(func(r pgx.Row) error {
		err := r.Scan(&oldestMicros)
		if err == pgx.ErrNoRows {
			return nil
		}
		return err
	})
	b.Queue(`SELECT count(*) FROM idem_outbox WHERE state = 'dead'`).QueryRow(func(r pgx.Row) error { return r.Scan(&s.Dead) })
	if err := db.SendBatch(ctx, b).Close(); err != nil {
		return s, err
	}
	if oldestMicros != nil {
		s.Oldest = time.Duration(*oldestMicros) * time.Microsecond
	}
	return s, nil
}
