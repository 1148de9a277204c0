// Package telemetry serves a consumer's metrics and health on metrics_addr
// (/metrics, /healthz, /readyz) and turns its metrics into the flat counts
// that --stats-file, idem chaos and the tests read.
package telemetry

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
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

// Check is one readiness condition: nil when it holds.
type Check struct {
	Name string
	// Required checks make /readyz fail; the others are only reported.
	Required bool
	Run      func(ctx context.Context) error
}

// checkTimeout bounds each readiness check.
const checkTimeout = time.Second

// Handler serves /metrics from g, /healthz (the process answers) and /readyz
// (every required check passes; each check's state is in the body).
func Handler(g prometheus.Gatherer, checks []Check) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
		ready, body := runChecks(r.Context(), checks)
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if !ready {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		fmt.Fprint(w, body)
	})
	return mux
}

// runChecks runs every check at once and reports whether the required ones
// passed, with one line per check.
func runChecks(ctx context.Context, checks []Check) (bool, string) {
	ctx, cancel := context.WithTimeout(ctx, checkTimeout)
	defer cancel()
	errs := make([]chan error, len(checks))
	for i, c := range checks {
		errs[i] = make(chan error, 1)
		go func() { errs[i] <- c.Run(ctx) }()
	}
	ready := true
	var b strings.Builder
	for i, c := range checks {
		err := <-errs[i]
		switch {
		case err == nil:
			fmt.Fprintf(&b, "%s: ok\n", c.Name)
		case c.Required:
			ready = false
			fmt.Fprintf(&b, "%s: failing: %v\n", c.Name, err)
		default:
			fmt.Fprintf(&b, "%s: failing (not required): %v\n", c.Name, err)
		}
	}
	if ready {
		return true, "ready\n" + b.String()
	}
	return false, "not ready\n" + b.String()
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

// Serve serves h on ln until ctx ends.
func Serve(ctx context.Context, ln net.Listener, h http.Handler) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
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

// Snapshot flattens idem's counters in g into counts keyed "outcome" (the
// total over reasons), "outcome/reason" (idem_deliveries_total),
// "breaker/from->to" (idem_breaker_transitions_total) and "count/name"
// (idem_<name>_total without labels).
func Snapshot(g prometheus.Gatherer) (map[string]int64, error) {
	families, err := g.Gather()
	if err != nil {
		return nil, err
	}
	out := map[string]int64{}
	for _, f := range families {
		name := f.GetName()
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
