package consumer

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/guard"
)

// BatchHandler is a Handler that applies many events in one statement or a
// few. The consumer uses ApplyBatch when the handler has it, and calls Apply
// once per event inside the batch's transaction when it does not.
type BatchHandler[T any] interface {
	Handler[T]
	// ApplyBatch performs the effects of vs through tx, which also holds
	// their dedup rows. vs holds distinct, new events. Take row locks in a
	// fixed order (sorted keys), so that two batches cannot deadlock. An
	// error fails the whole batch: the consumer splits it and retries the
	// halves, so that only the event that fails takes Apply's retry and
	// dead-letter path.
	ApplyBatch(ctx context.Context, tx pgx.Tx, vs []T) error
}

// hold is the one deadline of the deliveries of a gathered batch held in
// place while the store is unreachable: it starts at the batch's first hold
// and is carried through every split, so that no delivery is held longer
// than Config.StoreHold however often its batch was split. A batch's splits
// run one after another on one goroutine.
type hold struct{ until time.Time }

// over starts the clock at its first call and reports whether d has passed
// since.
func (h *hold) over(d time.Duration) bool {
	now := time.Now()
	if h.until.IsZero() {
		h.until = now.Add(d)
	}
	return !now.Before(h.until)
}

// handleBatch takes items to durable outcomes through one transaction and
// acks them. A failure that is not the store's being away splits the batch,
// until the event that fails stands alone and takes handleOne's path. While
// the store is away, items are held until h is over.
func (w *worker[T]) handleBatch(ctx context.Context, items []item[T], h *hold) {
	switch len(items) {
	case 0:
		return
	case 1:
		w.handleOne(ctx, items[0], h)
		return
	}
	cfg := &w.c.cfg
	events := make([]guard.Event, len(items))
	for i, it := range items {
		events[i] = it.ev
	}
	for wait := 1; ; wait++ {
		actx, cancel := context.WithTimeout(ctx, cfg.HandlerTimeout)
		res, err := w.c.guard.ProcessBatch(actx, events, w.applyBatch(items))
		timedOut := errors.Is(actx.Err(), context.DeadlineExceeded)
		cancel()
		if err == nil {
			w.settle(ctx, items, res)
			return
		}
		if ctx.Err() != nil {
			for _, it := range items {
				w.requeue(ctx, it, wire.RequeueShutdown, err)
			}
			return
		}
		verdict, reason := classify(err, timedOut)
		if verdict == holdInPlace {
			if h.over(cfg.StoreHold) {
				cfg.Logger.Warn("store unavailable for store_hold, handing the deliveries back", "deliveries", len(items), "err", err, "store_hold", cfg.StoreHold)
				for _, it := range items {
					w.requeue(ctx, it, reason, err)
				}
				return
			}
			cfg.Observer.Count(wire.CounterStoreRetry, 1)
			delay := cfg.RetryBackoff.Delay(wait)
			cfg.Logger.Warn("store unavailable, retrying in place", "deliveries", len(items), "err", err, "delay", delay)
			if !sleep(w.stop, delay) {
				for _, it := range items {
					w.requeue(ctx, it, wire.RequeueShutdown, err)
				}
				return
			}
			continue
		}
		// Nothing committed. The failure may be one event's: split.
		cfg.Observer.Count(wire.CounterBatchSplit, 1)
		cfg.Logger.Debug("batch failed, splitting it", "deliveries", len(items), "reason", reason, "err", err)
		mid := len(items) / 2
		w.handleBatch(ctx, items[:mid], h)
		w.handleBatch(ctx, items[mid:], h)
		return
	}
}

// applyBatch adapts the handler to the guard: it applies the claimed items.
func (w *worker[T]) applyBatch(items []item[T]) guard.BatchApplyFunc {
	return func(ctx context.Context, tx pgx.Tx, claimed []int) error {
		if bh, ok := w.c.handler.(BatchHandler[T]); ok {
			vs := make([]T, len(claimed))
			for k, i := range claimed {
				vs[k] = items[i].v
			}
			return bh.ApplyBatch(ctx, tx, vs)
		}
		for _, i := range claimed {
			if err := w.c.handler.Apply(ctx, tx, items[i].v); err != nil {
				return err
			}
		}
		return nil
	}
}

// settle acks a processed batch, and dead-letters its payload conflicts and
// the events the store refused. An
// item without an outcome (which the guard never returns) goes back to the
// queue rather than be acked.
func (w *worker[T]) settle(ctx context.Context, items []item[T], res []guard.Result) {
	acked := make([]item[T], 0, len(items))
	outcomes := make([]guard.Outcome, 0, len(items))
	for i, r := range res {
		switch r.Outcome {
		case guard.OutcomePayloadConflict:
			w.deadLetter(ctx, items[i], wire.ReasonPayloadConflict, r.Err)
			continue
		case guard.OutcomeRefused:
			// Outside the horizon the store enforces, checked at the claim.
			_, reason := classify(r.Err, false)
			w.deadLetter(ctx, items[i], reason, r.Err)
			continue
		case guard.OutcomeUnknown:
			w.c.cfg.Logger.Error("no outcome for a delivery of a decided batch: handing it back (a bug)", "event_id", items[i].ev.ID)
			w.requeue(ctx, items[i], wire.RequeueNoOutcome, nil)
			continue
		}
		acked = append(acked, items[i])
		outcomes = append(outcomes, r.Outcome)
	}
	w.ack(ctx, acked, outcomes)
}
