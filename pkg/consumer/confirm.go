package consumer

import (
	"context"

	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/guard"
)

// confirmStage settles the batches of one shard queued in c (confirmLater),
// in their order, until c's queue is closed and empty. A batch whose store
// does not answer is held, with those behind it (their store is the same),
// as a decider holds a batch, and handed back at its hold's end. The stage
// never runs a batch through the store itself: one whose markers the store
// did not confirm is decided on a goroutine of its own, so that no
// duplicate waits behind another event's transaction.
func (w *worker[T]) confirmStage(c *confirmShard[T]) {
	var queue []func() bool
	for {
		if len(queue) == 0 {
			if queue = c.queue.take(); queue == nil {
				return
			}
		} else {
			queue = append(queue, c.queue.takeNow()...)
		}
		if again := queue[0](); !again {
			queue = queue[1:]
		}
	}
}

// confirmLater queues s, a batch whose events not deferred all wait for the
// store's confirmation of their markers, for its shard's confirm stage.
func (w *worker[T]) confirmLater(ctx context.Context, s screened[T]) {
	c := w.confirms[w.c.guard.Shard(s.items[0].ev)]
	items := make([]item[T], 0, len(s.items))
	for i, it := range s.items {
		if !s.deferred[i] {
			items = append(items, it)
		}
	}
	h, wait := &hold{}, 0
	c.queue.add(func() (again bool) {
		if w.stop.Err() != nil && c.unanswered.Load() {
			// Shutting down, and the store did not answer the last
			// batch: the rest go back to the queue at once rather than
			// each wait for an answer.
			w.requeueAll(ctx, items, wire.RequeueShutdown, nil)
			return false
		}
		err := w.c.guard.Confirm(ctx, s.batch)
		c.unanswered.Store(err != nil)
		if err != nil {
			wait++
			return w.holdInPlace(ctx, items, h, wait, wire.RequeueStoreUnavailable, err)
		}
		w.settleConfirmed(ctx, c, s)
		return false
	})
}

// settleConfirmed hands the duplicates of s that the store confirmed to c's
// ack stage, or, if the store did not confirm the history of some markers,
// decides s (which sends those to the store and acks the batch whole) on a
// goroutine of its own: rare, once per key after the database's history
// changed.
func (w *worker[T]) settleConfirmed(ctx context.Context, c *confirmShard[T], s screened[T]) {
	settled := s.batch.Screened()
	if len(settled)+len(s.deferred) < len(s.items) {
		w.leftovers.Go(func() { w.decide(ctx, s) })
		return
	}
	dups := make([]item[T], len(settled))
	for k, i := range settled {
		dups[k] = s.items[i]
	}
	c.acks.add(dups...)
}

// ackStage acks the duplicates c's confirm stage settled, every one waiting
// in one call (one multiple-ack, as far as the deliveries below are
// settled), until c.acks is closed and empty. One history read confirms
// every batch screened before it was sent, and the stage settles them in a
// row; acked on the stage, each batch (each delivery, per event) cost a
// frame, and the batches behind it waited for the write, and so did the
// next read, which the stage asks for. The acks are sent while the stage
// goes on, and those that wait meanwhile go together.
func (w *worker[T]) ackStage(ctx context.Context, c *confirmShard[T]) {
	for {
		dups := c.acks.take()
		if dups == nil {
			return
		}
		outcomes := make([]guard.Outcome, len(dups))
		for i := range outcomes {
			outcomes[i] = guard.OutcomeDuplicateRedis
		}
		w.ack(ctx, dups, outcomes)
	}
}
