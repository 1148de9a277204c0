package replication

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

var (
	standbysDesc = prometheus.NewDesc("idem_postgres_standbys",
		"Standbys connected to the shard's database, as last read (pg_stat_replication).",
		[]string{"shard"}, nil)
	syncDesc = prometheus.NewDesc("idem_postgres_sync_standbys",
		"Synchronous standbys streaming from the shard's database, as last read: with standbys and none synchronous, an acked event can be lost on failover. Absent when the role cannot see it (grant pg_monitor).",
		[]string{"shard"}, nil)
	behindDesc = prometheus.NewDesc("idem_postgres_standby_behind_bytes",
		"WAL the closest streaming standby has not flushed, in bytes, as last read: what a failover to it would lose at most. Absent without a streaming standby, or when the role cannot see its position.",
		[]string{"shard"}, nil)
)

// Collector returns the Watcher's gauges, read from its last readings at
// each scrape: idem_postgres_standbys, idem_postgres_sync_standbys and
// idem_postgres_standby_behind_bytes, by shard. A shard not read yet, or
// whose last reading failed, has no series; nor has a count the role may
// not see (State.Hidden).
func (w *Watcher) Collector() prometheus.Collector { return collector{w} }

type collector struct{ w *Watcher }

func (c collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- standbysDesc
	ch <- syncDesc
	ch <- behindDesc
}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	sts, ok := c.w.states()
	for i, st := range sts {
		if !ok[i] {
			continue
		}
		shard := strconv.Itoa(i)
		ch <- prometheus.MustNewConstMetric(standbysDesc, prometheus.GaugeValue, float64(len(st.Standbys)), shard)
		if !st.Hidden {
			ch <- prometheus.MustNewConstMetric(syncDesc, prometheus.GaugeValue, float64(st.Synchronous()), shard)
		}
		if b, ok := st.Behind(); ok {
			ch <- prometheus.MustNewConstMetric(behindDesc, prometheus.GaugeValue, float64(b), shard)
		}
	}
}
