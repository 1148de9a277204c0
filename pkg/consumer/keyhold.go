package consumer

import (
	"context"
	"fmt"
)

// handBack hands it back to the queue for reason, after err, and with
// Config.KeyOrder holds its key until it comes back. The hold is recorded
// before the nack, so that the event cannot come back before it.
func (w *worker[T]) handBack(ctx context.Context, it item[T], reason string, err error) {
	if w.c.cfg.KeyOrder {
		w.holds.mu.Lock()
		w.holds.add(it.ev.ShardKey, it.ev.ID, reason)
		w.holds.mu.Unlock()
	}
	w.requeue(ctx, it, reason, err)
}

// passHeld hands back, in order, the items whose key is held, and returns
// the others. The first redelivery of an event handed back ends its key's
// hold: it and the key's items after it go on. Without Config.KeyOrder it
// returns items.
func (w *worker[T]) passHeld(ctx context.Context, items []item[T]) []item[T] {
	if !w.c.cfg.KeyOrder {
		return items
	}
	type back struct {
		it     item[T]
		reason string
	}
	var backs []back
	keep := make([]item[T], 0, len(items))
	k := &w.holds
	k.mu.Lock()
	for _, it := range items {
		h, ok := k.held[it.ev.ShardKey]
		switch {
		case !ok:
			keep = append(keep, it)
		case it.d.Redelivered && h.ids[it.ev.ID]:
			delete(k.held, it.ev.ShardKey)
			keep = append(keep, it)
		default:
			k.add(it.ev.ShardKey, it.ev.ID, h.reason)
			backs = append(backs, back{it, h.reason})
		}
	}
	k.mu.Unlock()
	for _, b := range backs {
		w.requeue(ctx, b.it, b.reason, fmt.Errorf("an earlier event of its key was handed back to the queue (%s), and it follows that event (key_order)", b.reason))
	}
	return keep
}
