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
// few. The consumer uses ApplyBatch for the new events of a batch when the
// handler has it, and calls Apply once per event inside the batch's
// transaction when it does not.
//
// A batch whose transaction fails is split and its halves retried, until
// the event that fails stands alone; a batch with one new event is applied
// with Apply.
type BatchHandler[T any] interface {
	Handler[T]
	// ApplyBatch performs the effects of vs through tx, which also holds
	// their dedup rows. vs holds distinct, new events. Take row locks in a
	// fixed order (sorted keys), so that two batches cannot deadlock. An
	// error fails the whole batch: the consumer splits it and retries the
	// halves, so that only the event that fails takes the retry and
	// dead-letter path.
	ApplyBatch(ctx context.Context, tx pgx.Tx, vs []T) error
}

// hold is the one deadline of the deliveries of a gathered batch held in
// place while the store is unreachable: Config.StoreHold from the arrival of
// its earliest delivery, carried through every split, so that no delivery
// is held longer than StoreHold from its arrival, however long it waited
// before its first hold and however often its batch was split. A batch's
// splits run one after another on one goroutine.
type hold struct{ until time.Time }

// over starts the clock at its first call, d from first (the earliest
// arrival of the held deliveries), and reports whether it has run out.
func (h *hold) over(first time.Time, d time.Duration) bool {
	if h.until.IsZero() {
		h.until = first.Add(d)
	}
	return !time.Now().Before(h.until)
}

// handle takes items to durable outcomes through one transaction and acks
// them: a single event is a batch of one. While the store is away, the items
// are held in place until h is over. Any other failure of several items
// splits them, until the event that fails stands alone; a lone event is
// dead-lettered at once if it can never succeed, retried with backoff up to
// Config.DeliveryLimit attempts otherwise (in place with KeyOrder, through
// the queue without). With KeyOrder, the items of a key held after a
// hand-back go back to the queue first (passHeld).
func (w *worker[T]) handle(ctx context.Context, items []item[T], h *hold) {
	w.handleScreened(ctx, items, h, nil)
}

// handleScreened is handle for items that b, unless nil, is the screened
// batch of: its first attempt decides b instead of screening them again.
func (w *worker[T]) handleScreened(ctx context.Context, items []item[T], h *hold, b *guard.Batch) {
	if w.handBackTripped(ctx, items) {
		if b != nil {
			w.c.guard.Abandon(ctx, b)
		}
		return
	}
	if b == nil {
		if items = w.passHeld(ctx, items); len(items) == 0 {
			return
		}
	}
	cfg := &w.c.cfg
	events := make([]guard.Event, len(items))
	for i, it := range items {
		events[i] = it.ev
	}
	attempt := deliveryCount(items[0].d) + 1 // a lone event's
	for wait := 1; ; wait++ {
		actx, cancel := context.WithTimeout(ctx, cfg.HandlerTimeout)
		var res []guard.Result
		var err error
		if b != nil {
			res, err = w.c.guard.Decide(actx, b, w.applyBatch(items))
			b = nil
		} else {
			res, err = w.c.guard.ProcessBatch(actx, events, w.applyBatch(items))
		}
		timedOut := errors.Is(actx.Err(), context.DeadlineExceeded)
		cancel()
		if err == nil {
			w.settle(ctx, items, res)
			return
		}
		if ctx.Err() != nil {
			// Drain timeout: the tx was rolled back; the broker redelivers.
			w.requeueAll(ctx, items, wire.RequeueShutdown, err)
			return
		}
		verdict, reason := classify(err, timedOut)
		if reason == wire.ReasonHandlerTimeout && !w.storeAnswers(ctx, items) {
			// The handler ran out of time on a store that does not
			// answer now (a silent link, a server gone): not the
			// events' doing, held as the store unreachable.
			verdict, reason = holdInPlace, wire.RequeueStoreUnavailable
		}
		if verdict == holdInPlace {
			if !w.holdInPlace(ctx, items, h, wait, reason, err) {
				return
			}
			continue
		}
		if len(items) > 1 {
			// Nothing committed. The failure may be one event's: split.
			cfg.Observer.Count(wire.CounterBatchSplit, 1)
			cfg.Logger.Debug("batch failed, splitting it", "deliveries", len(items), "reason", reason, "err", err)
			mid := len(items) / 2
			w.handle(ctx, items[:mid], h)
			w.handle(ctx, items[mid:], h)
			return
		}
		it := items[0]
		if verdict == deadLetterNow {
			w.deadLetter(ctx, it, reason, err)
			return
		}
		// A wait on a lock another transaction holds is not the event's
		// failure: it is never dead-lettered for its attempts (suspect),
		// and counts for the switch only once the lock outlasted what any
		// of this consumer's events can hold it (waitOutlasts).
		suspect := waited(err) && !cfg.KillSwitch.Off
		kill := killNone
		if !waited(err) || w.c.kill.waitOutlasts(it.ev.ID, cfg.HandlerTimeout) {
			kill = w.c.kill.failed(it.ev.ID, failureClass(reason, err), truncate(err.Error(), maxErrorHeader))
		}
		switch kill {
		case killOpen:
			// Distinct events fail this way: the deploy's fault, not this
			// event's. It goes back unspent, and the session ends.
			w.handBack(ctx, it, wire.RequeueKillSwitch, err)
			w.trip()
			return
		case killSuspect:
			suspect = true
		}
		switch {
		case attempt >= cfg.DeliveryLimit && suspect && attempt < cfg.BrokerDeliveryLimit:
			// Other events fail the same way (the switch may be about to
			// trip), or this one waited on another's lock: it is likely
			// innocent. It goes on being retried instead of
			// dead-lettered, up to the broker's own limit.
			cfg.Logger.Warn("attempts exhausted, but other events fail the same way or it waited on another's lock: retried until the kill switch decides",
				"event_id", it.ev.ID, "reason", reason, "attempt", attempt, "err", err, "delivery_limit", cfg.DeliveryLimit)
		case attempt >= cfg.DeliveryLimit:
			cfg.Logger.Error("attempts exhausted, dead-lettering", "event_id", it.ev.ID, "reason", reason, "attempt", attempt, "err", err, "delivery_limit", cfg.DeliveryLimit)
			w.deadLetter(ctx, it, reason, err)
			return
		}
		delay := cfg.RetryBackoff.Delay(attempt)
		cfg.Logger.Debug("attempt failed, will retry", "event_id", it.ev.ID, "reason", reason, "attempt", attempt, "delay", delay)
		if !sleep(w.stop, delay) {
			w.handBack(ctx, it, wire.RequeueShutdown, err)
			return
		}
		if !cfg.KeyOrder {
			w.requeue(ctx, it, reason, err)
			return
		}
		// Retry in place, holding the key: handed back to the queue, the
		// event would come after the ones behind it.
		attempt++
	}
}

// storeAnswers reports whether the store of items' shard answers within
// half a handler timeout: asked after an attempt ran out of time, it tells
// a handler that hung from a store that stopped answering under it.
func (w *worker[T]) storeAnswers(ctx context.Context, items []item[T]) bool {
	pctx, cancel := context.WithTimeout(ctx, w.c.cfg.HandlerTimeout/2)
	defer cancel()
	return w.c.guard.PingShard(pctx, w.c.guard.Shard(items[0].ev)) == nil
}

// holdInPlace waits before the wait-th retry of items while the store is
// unreachable, which is not the events' fault: the deliveries are held
// without spending their budget, and nothing is acked meanwhile. Once h is
// over, or on shutdown, it hands them back and returns false.
func (w *worker[T]) holdInPlace(ctx context.Context, items []item[T], h *hold, wait int, reason string, err error) bool {
	cfg := &w.c.cfg
	what := []any{"deliveries", len(items)}
	if len(items) == 1 {
		what = []any{"event_id", items[0].ev.ID}
	}
	if h.over(earliest(items), cfg.StoreHold) {
		msg := "store unavailable for store_hold, handing the deliveries back"
		if len(items) == 1 {
			msg = "store unavailable for store_hold, handing the delivery back"
		}
		cfg.Logger.Warn(msg, append(what, "reason", reason, "err", err, "store_hold", cfg.StoreHold)...)
		w.requeueAll(ctx, items, reason, err)
		if reason == wire.RequeueStoreUnavailable && w.c.guard.Shards() == 1 && !cfg.KeyOrder {
			// The store stayed away: every delivery this consumer holds
			// would wait as long. The session ends, handing them all back
			// to consumers that can reach their store, and the next one
			// starts once the store answers. With shards, one shard away
			// stops nothing else: the other shards' events go on, and
			// this shard's go back one batch at a time, each within
			// StoreHold of its arrival. With KeyOrder too: a session's end
			// returns its deliveries in no order the broker promises, and
			// the keys it holds (keyHolds) end with it.
			w.storeAway()
		}
		return false
	}
	cfg.Observer.Count(wire.CounterStoreRetry, 1)
	// The last retry starts by the hold's end: a delivery is handed back
	// at most one attempt (HandlerTimeout) past StoreHold from its arrival.
	delay := max(0, min(cfg.RetryBackoff.Delay(wait), time.Until(h.until)))
	cfg.Logger.Warn("store unavailable, retrying in place", append(what, "reason", reason, "err", err, "delay", delay)...)
	if !sleep(w.stop, delay) {
		w.requeueAll(ctx, items, wire.RequeueShutdown, err)
		return false
	}
	return true
}

// earliest returns when the first of items arrived.
func earliest[T any](items []item[T]) time.Time {
	first := items[0].received
	for _, it := range items[1:] {
		if it.received.Before(first) {
			first = it.received
		}
	}
	return first
}

// requeueAll hands every item back to the queue, in order.
func (w *worker[T]) requeueAll(ctx context.Context, items []item[T], reason string, err error) {
	for _, it := range items {
		w.handBack(ctx, it, reason, err)
	}
}

// applyBatch adapts the handler to the guard: it applies the claimed items,
// with ApplyBatch when the handler has it and more than one is new.
func (w *worker[T]) applyBatch(items []item[T]) guard.BatchApplyFunc {
	return func(ctx context.Context, tx pgx.Tx, claimed []int) error {
		if bh, ok := w.c.handler.(BatchHandler[T]); ok && len(claimed) > 1 {
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
			w.handBack(ctx, items[i], wire.RequeueNoOutcome, nil)
			continue
		}
		acked = append(acked, items[i])
		outcomes = append(outcomes, r.Outcome)
	}
	w.ack(ctx, acked, outcomes)
}
