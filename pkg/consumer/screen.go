package consumer

import (
	"context"
	"maps"
	"slices"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/guard"
)

// screened is a batch after the fast tier.
type screened[T any] struct {
	items []item[T]
	// batch is the guard's batch; nil in per-event mode, where handle
	// runs both tiers.
	batch *guard.Batch
	// deferred marks items taken out of the batch, to be screened again.
	deferred map[int]bool
	// done: nothing is left to decide (every item was deferred).
	done bool
	// confirm: every item not deferred is one the fast tier knows as done;
	// the confirm stage settles the batch once the store confirms the
	// history of its markers (confirmQueue).
	confirm bool
	// gathered: the batch stands for one the gatherer handed out, which
	// must be reported finished.
	gathered bool
	// With Config.KeyOrder: after are the batches before this one that
	// hold one of its keys, which it waits for; finished is closed once it
	// is decided.
	after    []chan struct{}
	finished chan struct{}
}

// screenStage is the pipeline's middle stage: it decodes each gathered batch,
// runs the guard's fast tier over it (one Redis round trip, overlapping the
// Postgres transactions of the batches before it) and hands what is left to
// the deciders, or, when the fast tier knows every event as done, to the
// confirm stage. An event another consumer holds the lease on is most likely
// being committed right now: rather than send it to Postgres, where its claim
// would wait on that transaction, it is deferred once, and screened again
// with the next batch, when Redis will likely know it as done. It never
// drops it: the second time it goes to the store whatever Redis says.
//
// Deferred events go on their own, without a next batch, when a BatchLinger
// timer fires and finds no batch of this worker being decided, or once they
// have waited maxDeferLingers. While a batch is being decided, the lease is
// most likely its own, and the next batch most likely waits only for the
// broker's window, which that batch holds: sent alone then, the deferred
// events would be a transaction of their own whose claims wait on that
// batch's rows. The wait scales with BatchLinger, which is unbounded; with
// a linger of 10 ms or more it may outlast the acker's hold (ackHold), and
// the acks held above the deferred deliveries then go a frame each.
func (w *worker[T]) screenStage(ctx context.Context, batches <-chan []amqp.Delivery, toDecide chan<- screened[T], finished chan<- struct{}) {
	defer close(toDecide)
	deferWait := w.c.cfg.BatchLinger
	maxWait := maxDeferLingers * deferWait
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	var carry []item[T]
	var carried time.Time // when carry was deferred
	// With KeyOrder: the last batch handed out that holds each key. A key
	// whose batch finished is dropped from it once it outgrows what can be
	// in flight, so that it never holds every key ever seen.
	holder := map[string]chan struct{}{}
	order := func(s *screened[T]) {
		if !w.c.cfg.KeyOrder || s.done {
			return
		}
		if len(holder) > 2*w.c.cfg.Prefetch {
			maps.DeleteFunc(holder, func(_ string, done chan struct{}) bool { return isClosed(done) })
		}
		s.finished = make(chan struct{})
		for _, it := range s.items {
			k := it.ev.ShardKey
			if prev, ok := holder[k]; ok && prev != s.finished && !isClosed(prev) && !slices.Contains(s.after, prev) {
				s.after = append(s.after, prev)
			}
			holder[k] = s.finished
		}
	}
	for {
		var ds []amqp.Delivery
		gathered := true
		if len(carry) > 0 {
			timer.Reset(deferWait)
		}
		select {
		case b, ok := <-batches:
			if !ok {
				if len(carry) > 0 {
					ss, _ := w.screen(ctx, nil, carry)
					for _, s := range ss {
						order(&s)
						w.pass(ctx, s, toDecide, finished)
					}
				}
				return
			}
			ds = b
		case <-timer.C:
			if w.deciding.Load() > 0 && time.Since(carried) < maxWait {
				continue // wait on for the next batch
			}
			gathered = false // the carried items alone
		}
		timer.Stop()
		ss, deferred := w.screen(ctx, ds, carry)
		if carry = deferred; len(carry) > 0 {
			carried = time.Now()
		}
		for i, s := range ss {
			// The gatherer counts batches in flight: one report per
			// gathered batch, however many shards it was split over.
			s.gathered = gathered && i == len(ss)-1
			order(&s)
			w.pass(ctx, s, toDecide, finished)
		}
	}
}

// maxDeferLingers bounds, in BatchLingers, how long deferred events wait for
// a next batch while batches of their worker are being decided
// (screenStage): 100 ms by default, many times a batch's transaction on a
// loaded machine.
const maxDeferLingers = 20

// isClosed reports whether ch is closed.
func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// handBackTripped hands items back untried if the kill switch tripped in
// this session, and reports whether it did.
func (w *worker[T]) handBackTripped(ctx context.Context, items []item[T]) bool {
	if !isClosed(w.tripped) {
		return false
	}
	w.requeueAll(ctx, items, wire.RequeueKillSwitch, w.c.kill.cause())
	return true
}

// pass hands s to the deciders, or to the confirm stage, or reports it
// finished if nothing is left. A batch that waits for confirmation is no
// work for a decider: the gatherer counts it finished at once.
func (w *worker[T]) pass(ctx context.Context, s screened[T], toDecide chan<- screened[T], finished chan<- struct{}) {
	if s.confirm {
		w.confirmLater(ctx, s)
	} else if !s.done {
		w.deciding.Add(1)
		toDecide <- s
		return
	}
	if s.gathered {
		finished <- struct{}{}
	}
}

// screen decodes ds, dead-letters what cannot be processed and runs the fast
// tier over the rest and over carry (items deferred before), one batch per
// shard the items map to (a transaction cannot span databases). A batch the
// fast tier knows whole as done is settled by the confirm stage; any other is
// acked whole once decided, in one multiple-ack, rather than split around
// deliveries still in progress. It returns at least one batch, and the items it deferred.
func (w *worker[T]) screen(ctx context.Context, ds []amqp.Delivery, carry []item[T]) ([]screened[T], []item[T]) {
	items := append(make([]item[T], 0, len(carry)+len(ds)), carry...)
	now := time.Now()
	for _, d := range ds {
		if it, ok := w.prepare(ctx, d, now); ok {
			items = append(items, it)
		}
	}
	g := w.c.guard
	if g.Shards() == 1 || len(items) < 2 {
		s, deferred := w.screenShard(ctx, items)
		return []screened[T]{s}, deferred
	}
	byShard := make([][]item[T], g.Shards())
	for _, it := range items {
		k := g.Shard(it.ev)
		byShard[k] = append(byShard[k], it)
	}
	var out []screened[T]
	var deferred []item[T]
	for _, group := range byShard {
		if len(group) == 0 {
			continue
		}
		s, d := w.screenShard(ctx, group)
		out = append(out, s)
		deferred = append(deferred, d...)
	}
	return out, deferred
}

// screenShard is screen for items that all map to one shard.
func (w *worker[T]) screenShard(ctx context.Context, items []item[T]) (screened[T], []item[T]) {
	switch {
	case len(items) == 0:
		return screened[T]{done: true}, nil
	case w.c.cfg.BatchSize == 1 || len(items) == 1:
		return screened[T]{items: items}, nil
	}
	events := make([]guard.Event, len(items))
	for i, it := range items {
		events[i] = it.ev
	}
	b, err := w.c.guard.Screen(ctx, events)
	if err != nil {
		// Not reached: prepare validated every event. handle decides.
		return screened[T]{items: items}, nil
	}
	s := screened[T]{items: items, batch: b, deferred: map[int]bool{}}
	// Defer by ID, every copy together, and each ID at most once: if any
	// copy was deferred before, they all go to the store now. With
	// KeyOrder nothing is deferred: a deferred event would be applied
	// after later ones of its key.
	byID := map[string][]int{}
	if !w.c.cfg.KeyOrder {
		for _, i := range b.Leased() {
			byID[items[i].ev.ID] = append(byID[items[i].ev.ID], i)
		}
	}
	var later []int
	var deferred []item[T]
	for _, group := range byID {
		if slices.ContainsFunc(group, func(i int) bool { return items[i].deferred }) {
			continue
		}
		for _, i := range group {
			later = append(later, i)
			s.deferred[i] = true
			it := items[i]
			it.deferred = true
			deferred = append(deferred, it)
		}
	}
	if len(later) > 0 {
		b.Defer(later)
		w.c.cfg.Observer.Count(wire.CounterDeferred, 1)
	}
	unconfirmed := len(b.Unconfirmed())
	switch {
	case unconfirmed+len(s.deferred) < len(items):
		// Some go to the store: the claim confirms the markers too.
		return s, deferred
	case unconfirmed == 0:
		return screened[T]{done: true}, deferred // every one deferred
	case w.c.cfg.KeyOrder:
		// A marker the store does not confirm sends its event to the
		// store, in its key's order: a decider confirms it in turn.
		return s, deferred
	}
	s.confirm = true
	return s, deferred
}

// handleAlone takes the items of a batch the screen stage left to a decider
// (one event, or BatchSize 1) to durable outcomes. One event is screened
// here: the fast tier's round trip runs on the deciders, side by side, and
// an event it knows as done goes to the confirm stage, which has it acked
// once the store confirms its marker, while this decider takes the next.
func (w *worker[T]) handleAlone(ctx context.Context, items []item[T]) {
	if len(items) != 1 || w.c.cfg.KeyOrder || isClosed(w.tripped) {
		w.handle(ctx, items, &hold{})
		return
	}
	b, err := w.c.guard.Screen(ctx, []guard.Event{items[0].ev})
	if err != nil {
		w.handle(ctx, items, &hold{}) // not reached: prepare validated it
		return
	}
	if len(b.Unconfirmed()) == 1 {
		w.confirmLater(ctx, screened[T]{items: items, batch: b, confirm: true})
		return
	}
	w.handleScreened(ctx, items, &hold{}, b)
}

// decide takes a screened batch to durable outcomes and acks it. With
// Config.KeyOrder it first waits for the batches before it that share a key,
// and hands back the items of a key held after a hand-back (passHeld).
func (w *worker[T]) decide(ctx context.Context, s screened[T]) {
	if s.finished != nil {
		for _, prev := range s.after {
			<-prev
		}
		defer close(s.finished)
	}
	if s.batch == nil {
		w.handleAlone(ctx, s.items)
		return
	}
	items := make([]item[T], 0, len(s.items))
	for i, it := range s.items {
		if !s.deferred[i] {
			items = append(items, it)
		}
	}
	if isClosed(w.tripped) {
		w.c.guard.Abandon(ctx, s.batch)
		w.handBackTripped(ctx, items)
		return
	}
	if keep := w.passHeld(ctx, items); len(keep) < len(items) {
		// A key of the batch is held: its items went back to the queue,
		// and the rest are screened again without them.
		w.c.guard.Abandon(ctx, s.batch)
		w.handle(ctx, keep, &hold{})
		return
	}
	actx, cancel := context.WithTimeout(ctx, w.c.cfg.HandlerTimeout)
	res, err := w.c.guard.Decide(actx, s.batch, w.applyBatch(s.items))
	cancel()
	var outcomes []guard.Result
	for i := range s.items {
		if !s.deferred[i] && err == nil {
			outcomes = append(outcomes, res[i])
		}
	}
	if err == nil {
		w.settle(ctx, items, outcomes)
		return
	}
	// Nothing committed and the leases are released: take the batch
	// through the full path, which retries, holds or splits as the error
	// asks. The duplicates the fast tier found are found again.
	w.handle(ctx, items, &hold{})
}
