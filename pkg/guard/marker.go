package guard

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/idemhq/idem/internal/step"
	"github.com/idemhq/idem/internal/tier"
)

// maxPendingMarkers bounds the done markers waiting to be written. Past it
// new ones are dropped: a lost marker costs the next duplicate one trip to
// the store, and a Redis that cannot keep up must not grow the heap.
const maxPendingMarkers = 16384

// markerWriter writes done markers after their commit, off the ack path.
// Markers queued while a write is in flight go out together in the next
// pipeline, so a busy consumer writes few, large pipelines and an idle one
// writes at once. No goroutine runs while nothing is queued.
type markerWriter struct {
	fast  FastPath
	scope string
	obs   Observer
	log   *slog.Logger

	mu      sync.Mutex
	pending []marks
	queued  int           // events in pending
	idle    chan struct{} // closed when the running writer drains the queue; nil when none runs
}

// marks are done markers to write for events that committed in one history.
type marks struct {
	history tier.History
	events  []Event
}

// add queues markers for events whose rows are committed in history.
func (w *markerWriter) add(history tier.History, events []Event) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.queued+len(events) > maxPendingMarkers {
		w.log.Debug("done markers dropped: the fast tier is not keeping up", "events", len(events))
		return
	}
	w.queued += len(events)
	if n := len(w.pending); n > 0 && w.pending[n-1].history == history {
		w.pending[n-1].events = append(w.pending[n-1].events, events...)
	} else {
		w.pending = append(w.pending, marks{history: history, events: slices.Clone(events)})
	}
	if w.idle == nil {
		w.idle = make(chan struct{})
		go w.run(w.idle)
	}
}

func (w *markerWriter) run(idle chan struct{}) {
	for {
		w.mu.Lock()
		queue := w.pending
		w.pending, w.queued = nil, 0
		if len(queue) == 0 {
			w.idle = nil
			close(idle)
			w.mu.Unlock()
			return
		}
		w.mu.Unlock()
		for _, m := range byHistory(queue) {
			w.write(m)
		}
	}
}

// write writes one history's markers in one call. The fast tier bounds it
// with its own timeout.
func (w *markerWriter) write(m marks) {
	ctx := context.Background()
	began := time.Now()
	err := w.fast.MarkDone(ctx, w.scope, m.history, m.events)
	w.obs.ObserveStage(ctx, StageMarkDone, len(m.events), time.Since(began), err)
	if err != nil {
		w.log.DebugContext(ctx, "mark done", "events", len(m.events), "err", err)
	}
	for range m.events {
		step.Reached(ctx, step.MarkedDone)
	}
}

// byHistory merges queued markers of one history (each shard has its own),
// so that each history costs one pipeline.
func byHistory(queue []marks) []marks {
	if len(queue) == 1 {
		return queue
	}
	var out []marks
	at := map[tier.History]int{}
	for _, m := range queue {
		if k, ok := at[m.history]; ok {
			out[k].events = append(out[k].events, m.events...)
			continue
		}
		at[m.history] = len(out)
		out = append(out, m)
	}
	return out
}

// flush waits until every queued marker has been written (or failed).
func (w *markerWriter) flush(ctx context.Context) error {
	w.mu.Lock()
	idle := w.idle
	w.mu.Unlock()
	if idle == nil {
		return nil
	}
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
