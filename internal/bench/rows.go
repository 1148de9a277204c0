package bench

import (
	"fmt"
	"time"
)

// Row is one configuration the bench measures.
type Row struct {
	Name string `json:"name"`
	// Mode is "raw" (consume and ack, the ceiling) or "idem".
	Mode string `json:"mode"`
	// Env configures the idem workers (IDEM_* variables).
	Env []string `json:"env,omitempty"`
	// Dups is the fraction of messages that are re-sends of an event
	// already in the stream; 1 means a stream processed once already.
	Dups float64 `json:"dups"`
	// Procs is how many consumer processes share the queue.
	Procs int `json:"procs"`
	// RedisDown points the workers at a port where nothing listens.
	RedisDown bool `json:"redisDown,omitempty"`
	// Prefilled runs on a dedup table holding Options.Prefill rows.
	Prefilled bool `json:"prefilled,omitempty"`
	// Latency publishes at Options.Rate while the workers consume, and
	// measures publish-to-ack latency, instead of draining a backlog.
	Latency bool `json:"latency,omitempty"`
	// PGLatency puts PostgreSQL this far from the workers, round trip:
	// their DATABASE_URL goes through a proxy that delays every reply
	// (Options.PGLatency; nanoseconds in JSON).
	PGLatency time.Duration `json:"pgLatency,omitempty"`
	// Baseline names the row this one's throughput is compared with.
	Baseline string `json:"baseline"`
}

// Settings of the two pipelines. Per-event is the consumer as it was before
// batching: 16 workers, prefetch 64.
var (
	perEvent = []string{"IDEM_CONSUMER_BATCH_SIZE=1", "IDEM_CONSUMER_WORKERS=16", "IDEM_CONSUMER_PREFETCH=64"}
	batched  = []string{} // the defaults
	redisOff = "IDEM_REDIS_ENABLED=false"
)

func with(env []string, more ...string) []string {
	return append(append([]string{}, env...), more...)
}

// Rows lists every row, in the order they run and print; with pgLatency
// above zero, the remote rows end the list.
func Rows(pgLatency time.Duration) []Row {
	var rows []Row
	for _, d := range []struct {
		pct  string
		dups float64
	}{{"0%", 0}, {"25%", 0.25}, {"100%", 1}} {
		raw := "raw " + d.pct
		rows = append(rows,
			Row{Name: raw, Mode: "raw", Dups: d.dups, Procs: 1, Baseline: raw},
			Row{Name: "per-event, Redis on, " + d.pct, Mode: "idem", Env: perEvent, Dups: d.dups, Procs: 1, Baseline: raw},
			Row{Name: "per-event, Redis off, " + d.pct, Mode: "idem", Env: with(perEvent, redisOff), Dups: d.dups, Procs: 1, Baseline: raw},
			Row{Name: "batched, Redis on, " + d.pct, Mode: "idem", Env: batched, Dups: d.dups, Procs: 1, Baseline: raw},
			Row{Name: "batched, Redis off, " + d.pct, Mode: "idem", Env: with(batched, redisOff), Dups: d.dups, Procs: 1, Baseline: raw},
		)
	}
	rows = append(rows,
		Row{Name: "batched, Redis down, 25%", Mode: "idem", Env: batched, Dups: 0.25, Procs: 1, RedisDown: true, Baseline: "raw 25%"},
		Row{Name: "batched, key order, 25%", Mode: "idem", Env: with(batched, "IDEM_CONSUMER_KEY_ORDER=true"), Dups: 0.25, Procs: 1, Baseline: "batched, Redis on, 25%"},
		Row{Name: "batched, 2 processes, 25%", Mode: "idem", Env: batched, Dups: 0.25, Procs: 2, Baseline: "batched, Redis on, 25%"},
		Row{Name: "batched, 10M-row table, 25%", Mode: "idem", Env: batched, Dups: 0.25, Procs: 1, Prefilled: true, Baseline: "batched, Redis on, 25%"},
		Row{Name: "batched, latency at fixed rate, 25%", Mode: "idem", Env: batched, Dups: 0.25, Procs: 1, Latency: true, Baseline: "raw 25%"},
	)
	if pgLatency <= 0 {
		return rows
	}
	// Each remote row is compared with the same row beside Postgres: the
	// ratio is what the hop costs.
	away := fmt.Sprintf(", Postgres %d ms away", pgLatency.Milliseconds())
	for _, p := range []struct {
		name string
		env  []string
	}{{"per-event", perEvent}, {"batched", batched}} {
		for _, d := range []struct {
			pct  string
			dups float64
		}{{"25%", 0.25}, {"100%", 1}} {
			on, off := p.name+", Redis on, "+d.pct, p.name+", Redis off, "+d.pct
			rows = append(rows,
				Row{Name: on + away, Mode: "idem", Env: p.env, Dups: d.dups, Procs: 1, PGLatency: pgLatency, Baseline: on},
				Row{Name: off + away, Mode: "idem", Env: with(p.env, redisOff), Dups: d.dups, Procs: 1, PGLatency: pgLatency, Baseline: off},
			)
		}
	}
	return rows
}
