// Package telemetry serves a consumer's metrics and health on metrics_addr
// (/metrics, /healthz, /readyz) and turns its metrics into the flat counts
// that --stats-file, idem-lab chaos and the tests read.
package telemetry

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"runtime/debug"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
)

// NewRegistry returns a registry holding the Go runtime (go_*) and process
// (process_*) collectors and idem_build_info.
func NewRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	version, revision, goVersion := "unknown", "unknown", "unknown"
	if bi, ok := debug.ReadBuildInfo(); ok {
		version, goVersion = bi.Main.Version, bi.GoVersion
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" {
				revision = s.Value
			}
		}
	}
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name:        "idem_build_info",
		Help:        "Always 1; the labels say which build of idem runs.",
		ConstLabels: prometheus.Labels{"version": version, "revision": revision, "goversion": goVersion},
	}, func() float64 { return 1 }))
	return reg
}

// Handler serves /metrics from g and everything else (the probes) from
// health.
func Handler(g prometheus.Gatherer, health http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{}))
	mux.Handle("/", health)
	return mux
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

// The server's bounds on a client: metrics_addr is for scrapers and
// probes, which send no body and read a small answer, so a slow or idle
// client is dropped rather than holding a connection.
const (
	ReadHeaderTimeout = 5 * time.Second
	ReadTimeout       = 5 * time.Second
	WriteTimeout      = 10 * time.Second
	IdleTimeout       = 60 * time.Second
)

// NewServer returns the server for metrics_addr, serving h with the
// timeouts above.
func NewServer(h http.Handler) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: ReadHeaderTimeout,
		ReadTimeout:       ReadTimeout,
		WriteTimeout:      WriteTimeout,
		IdleTimeout:       IdleTimeout,
	}
}

// Serve serves h on ln until ctx ends.
func Serve(ctx context.Context, ln net.Listener, h http.Handler) error {
	srv := NewServer(h)
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	err := srv.Serve(ln)
	<-stopped
	if err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("metrics: %w", err)
	}
	return nil
}

// GaugeUnacked keys, in a Snapshot, the consumer's unacked deliveries now
// (idem_prefetch_in_use): in flight, or settled and waiting for their ack.
const GaugeUnacked = "gauge/unacked"

// Snapshot flattens idem's counters in g into counts keyed "outcome" (the
// total over reasons), "outcome/reason" (idem_deliveries_total),
// "breaker/from->to" (idem_breaker_transitions_total) and "count/name"
// (idem_<name>_total without labels), with GaugeUnacked beside them.
func Snapshot(g prometheus.Gatherer) (map[string]int64, error) {
	families, err := g.Gather()
	if err != nil {
		return nil, err
	}
	out := map[string]int64{}
	for _, f := range families {
		name := f.GetName()
		if name == "idem_prefetch_in_use" {
			for _, m := range f.GetMetric() {
				out[GaugeUnacked] = int64(m.GetGauge().GetValue())
			}
			continue
		}
		if f.GetType() != dto.MetricType_COUNTER || !strings.HasPrefix(name, "idem_") {
			continue
		}
		for _, m := range f.GetMetric() {
			v := int64(m.GetCounter().GetValue())
			l := labels(m)
			switch {
			case name == "idem_deliveries_total":
				out[l["outcome"]] += v
				if l["reason"] != "" {
					out[l["outcome"]+"/"+l["reason"]] += v
				}
			case name == "idem_outbox_attempts_total":
				out["outbox/"+l["result"]] += v
			case name == "idem_outbox_destination_pauses_total":
				out["outbox/paused"] += v
			case name == "idem_breaker_transitions_total":
				out["breaker/"+l["from"]+"->"+l["to"]] += v
			case len(l) == 0:
				out["count/"+strings.TrimSuffix(strings.TrimPrefix(name, "idem_"), "_total")] = v
			}
		}
	}
	return out, nil
}

func labels(m *dto.Metric) map[string]string {
	out := map[string]string{}
	for _, lp := range m.GetLabel() {
		out[lp.GetName()] = lp.GetValue()
	}
	return out
}

// WriteStats writes v as JSON to path through a temporary file and a
// rename, so that a reader (Proc.Stats) never sees a torn file, even when
// the writer is killed mid-write.
func WriteStats(path string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// WriteStatsEvery writes snapshot() to path with WriteStats every interval
// until the returned func is called; that func stops the writer and writes
// a last time. onErr, if set, sees failed writes.
func WriteStatsEvery(path string, interval time.Duration, snapshot func() any, onErr func(error)) (stop func()) {
	write := func() {
		if err := WriteStats(path, snapshot()); err != nil && onErr != nil {
			onErr(err)
		}
	}
	quit, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				write()
			case <-quit:
				return
			}
		}
	}()
	return func() {
		close(quit)
		<-done
		write()
	}
}
