// Package telemetry counts what the consumer does (outcomes by reason,
// breaker transitions) and serves the counts in Prometheus text format.
package telemetry

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/idemhq/idem/pkg/guard"
)

// Metrics is a set of counters safe for concurrent use.
type Metrics struct {
	mu       sync.Mutex
	outcomes map[[2]string]int64 // {outcome, reason}
	breaker  map[[2]string]int64 // {from, to}
	counts   map[string]int64    // consumer.Counter* names
	state    string
}

// New returns empty counters.
func New() *Metrics {
	m := &Metrics{outcomes: map[[2]string]int64{}, breaker: map[[2]string]int64{}, counts: map[string]int64{}, state: "closed"}
	for _, o := range guard.Outcomes() {
		m.outcomes[[2]string{o.String(), ""}] = 0
	}
	return m
}

// Outcome counts one delivery's outcome.
func (m *Metrics) Outcome(o guard.Outcome, reason string) {
	m.mu.Lock()
	m.outcomes[[2]string{o.String(), reason}]++
	m.mu.Unlock()
}

// Count counts one occurrence of a named event (a consumer.Counter*).
func (m *Metrics) Count(name string) {
	m.mu.Lock()
	m.counts[name]++
	m.mu.Unlock()
}

// BreakerChange counts one circuit breaker transition.
func (m *Metrics) BreakerChange(from, to string) {
	m.mu.Lock()
	m.breaker[[2]string{from, to}]++
	m.state = to
	m.mu.Unlock()
}

// Snapshot returns counts keyed "outcome" (the total over reasons),
// "outcome/reason", "breaker/from->to" and "count/name".
func (m *Metrics) Snapshot() map[string]int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[string]int64{}
	for k, v := range m.outcomes {
		out[k[0]] += v
		if k[1] != "" {
			out[k[0]+"/"+k[1]] += v
		}
	}
	for k, v := range m.breaker {
		out["breaker/"+k[0]+"->"+k[1]] += v
	}
	for k, v := range m.counts {
		out["count/"+k] = v
	}
	return out
}

// LogValue makes the counters print as one structured attribute.
func (m *Metrics) LogValue() slog.Value {
	snap := m.Snapshot()
	keys := make([]string, 0, len(snap))
	for k := range snap {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	attrs := make([]slog.Attr, 0, len(keys))
	for _, k := range keys {
		attrs = append(attrs, slog.Int64(k, snap[k]))
	}
	return slog.GroupValue(attrs...)
}

// WriteProm writes the counters in Prometheus text exposition format.
func (m *Metrics) WriteProm(w io.Writer) {
	m.mu.Lock()
	defer m.mu.Unlock()
	fmt.Fprintln(w, "# HELP idem_deliveries_total Deliveries by outcome and reason.")
	fmt.Fprintln(w, "# TYPE idem_deliveries_total counter")
	for _, k := range sortedKeys(m.outcomes) {
		fmt.Fprintf(w, "idem_deliveries_total{outcome=%q,reason=%q} %d\n", k[0], k[1], m.outcomes[k])
	}
	fmt.Fprintln(w, "# HELP idem_breaker_transitions_total Redis circuit breaker transitions.")
	fmt.Fprintln(w, "# TYPE idem_breaker_transitions_total counter")
	for _, k := range sortedKeys(m.breaker) {
		fmt.Fprintf(w, "idem_breaker_transitions_total{from=%q,to=%q} %d\n", k[0], k[1], m.breaker[k])
	}
	for _, name := range slices.Sorted(maps.Keys(m.counts)) {
		fmt.Fprintf(w, "# TYPE idem_%s_total counter\nidem_%s_total %d\n", name, name, m.counts[name])
	}
	fmt.Fprintln(w, "# HELP idem_breaker_open Whether the Redis circuit breaker is open (1) or not (0).")
	fmt.Fprintln(w, "# TYPE idem_breaker_open gauge")
	open := 0
	if m.state == "open" {
		open = 1
	}
	fmt.Fprintf(w, "idem_breaker_open %d\n", open)
}

func sortedKeys(m map[[2]string]int64) [][2]string {
	keys := make([][2]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if keys[i][0] != keys[j][0] {
			return keys[i][0] < keys[j][0]
		}
		return keys[i][1] < keys[j][1]
	})
	return keys
}

// Listen binds addr for Serve, so that a bad or taken address is an error
// at start rather than a log line later.
func Listen(addr string) (net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics_addr %q: %w", addr, err)
	}
	return ln, nil
}

// Serve serves /metrics on ln until ctx ends.
func (m *Metrics) Serve(ctx context.Context, ln net.Listener) error {
	mux := http.NewServeMux()
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		m.WriteProm(w)
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("metrics: %w", err)
	}
	return nil
}
