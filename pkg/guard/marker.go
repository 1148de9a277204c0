package guard

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/idemhq/idem/internal/step"
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
	pending []Event
	idle    chan struct{} // closed when the running writer drains the queue; nil when none runs
}

// add queues markers for events whose rows are committed.
func (w *markerWriter) add(events []Event) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.pending)+len(events) > maxPendingMarkers {
		w.log.Debug("done markers dropped: the fast tier is not keeping up", "events", len(events))
		return
	}
	w.pending = append(w.pending, events...)
	if w.idle == nil {
		w.idle = make(chan struct{})
		go w.run(w.idle)
	}
}

func (w *markerWriter) run(idle chan struct{}) {
	for {
		w.mu.Lock()
		batch := w.pending
		w.pending = nil
		if len(batch) == 0 {
			w.idle = nil
			close(idle)
			w.mu.Unlock()
			return
		}
		w.mu.Unlock()
		// The fast tier bounds the call with its own timeout.
		ctx := context.Background()
		began := time.Now()
		err := w.fast.MarkDone(ctx, w.scope, batch)
		w.obs.ObserveStage(ctx, StageMarkDone, len(batch), time.Since(began), err)
		if err != nil {
			w.log.DebugContext(ctx, "mark done", "events", len(batch), "err", err)
		}
		for range batch {
			step.Reached(ctx, step.MarkedDone)
		}
	}
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
