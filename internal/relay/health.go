package relay

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/idemhq/idem/internal/telemetry"
)

// ReadyLines returns /readyz's lines for relays: "relay" (required: every
// relay's last pass reached the database and its destinations) and
// "outbox" (reported: the backlog), and whether the required one holds.
func ReadyLines(ctx context.Context, rs []*Relay) (bool, string) {
	var b strings.Builder
	ready := true
	var errs []string
	for i, r := range rs {
		if err := r.Ready(); err != nil {
			ready = false
			if len(rs) > 1 {
				errs = append(errs, fmt.Sprintf("shard %d: %v", i, err))
			} else {
				errs = append(errs, err.Error())
			}
		}
	}
	if ready {
		b.WriteString("relay: ok\n")
	} else {
		fmt.Fprintf(&b, "relay: failing: %s\n", strings.Join(errs, "; "))
	}
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	for i, r := range rs {
		s, err := ReadBacklog(ctx, r.cfg.DB)
		on := ""
		if len(rs) > 1 {
			on = fmt.Sprintf(" (shard %d)", i)
		}
		switch {
		case err != nil:
			fmt.Fprintf(&b, "outbox%s: failing (not required): cannot read the backlog: %v\n", on, err)
		case s.Dead > 0:
			fmt.Fprintf(&b, "outbox%s: failing (not required): %d dead row(s) (idem outbox list --dead); %d pending, the oldest %s old\n", on, s.Dead, s.Pending, s.Oldest.Round(time.Millisecond))
		default:
			fmt.Fprintf(&b, "outbox%s: ok: %d pending, the oldest %s old\n", on, s.Pending, s.Oldest.Round(time.Millisecond))
		}
	}
	return ready, b.String()
}

// Health serves /healthz and /readyz for a process that runs only relays;
// /readyz reads the backlogs at most once a second (telemetry.ReadyCache).
func Health(rs []*Relay) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.Handle("/readyz", telemetry.CacheReady(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ready, body := ReadyLines(r.Context(), rs)
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if !ready {
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprint(w, "not ready\n"+body)
			return
		}
		fmt.Fprint(w, "ready\n"+body)
	})))
	return mux
}
