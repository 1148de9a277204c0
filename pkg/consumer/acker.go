package consumer

import (
	"slices"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// ackHold is the longest an ack waits for the deliveries below it to settle,
// so that one multiple-ack can cover them all, before it is sent on its own.
// The usual gap below a held ack is an event set aside for the next batch
// (its Redis lease held by a batch committing now), which closes within a
// batch or two; an ack sent on its own is a frame, and on a quorum queue a
// log entry, per delivery. A hold is also bounded in count (newAcker).
const ackHold = 200 * time.Millisecond

// acker settles the deliveries of one consume channel in as few frames as is
// safe. A multiple-ack up to tag t acks every unacked delivery at or below t,
// so it may only be sent once every delivery below t is settled. A delivery
// settled above one still in progress (a batch that finished before the batch
// below it) is held for up to ackHold, until a multiple-ack can cover it,
// and while fewer than maxHeld are held; after that it is acked on its own.
//
// Every settlement goes through the acker: a delivery acked behind its back
// would be acked again by a later multiple-ack, which the broker answers by
// closing the channel.
type acker struct {
	ch      amqp.Acknowledger
	maxHeld int // held acks that are sent at once rather than wait longer

	mu        sync.Mutex
	unsettled map[uint64]struct{} // registered, outcome not reached
	held      map[uint64]struct{} // settled, ack not sent yet
	sent      map[uint64]struct{} // settled, ack or nack sent, at or above low
	low       uint64              // every tag below low is settled
	high      uint64              // the highest tag registered
	timer     *time.Timer         // flushes held acks after ackHold
	frames    int64               // ack and nack frames sent
	err       error               // the first failed send, reported by the next call
}

// newAcker returns the acker of channel ch. Held acks take room in the
// broker's prefetch window, so that once maxHeld of them wait they are all
// sent at once (the consumer gives half the prefetch of one queue's
// consumer, the smallest window the channel's acks count against): a gap
// that stays open never stalls the deliveries.
func newAcker(ch amqp.Acknowledger, maxHeld int) *acker {
	return &acker{ch: ch, maxHeld: max(maxHeld, 1), unsettled: map[uint64]struct{}{}, held: map[uint64]struct{}{}, sent: map[uint64]struct{}{}, low: 1}
}

// register records a delivery as it arrives. The broker numbers a channel's
// deliveries 1, 2, 3…; a tag not registered yet (a delivery of another
// queue's consumer on the channel, still on its way) stops multiple-acks
// below it, so tags may be registered in any order.
func (a *acker) register(tag uint64) {
	a.mu.Lock()
	a.unsettled[tag] = struct{}{}
	a.high = max(a.high, tag)
	a.mu.Unlock()
}

// ack acks tags, whose outcomes are durable: at once with one multiple-ack
// as far as everything below is settled, the rest within ackHold.
func (a *acker) ack(tags []uint64) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, t := range tags {
		delete(a.unsettled, t)
		a.held[t] = struct{}{}
	}
	a.sendCovered()
	switch {
	case len(a.held) >= a.maxHeld:
		a.flushLocked()
	case len(a.held) > 0 && a.timer == nil:
		a.timer = time.AfterFunc(ackHold, a.flush)
	}
	return a.takeErr()
}

// counts reports the deliveries registered and not settled, and those
// settled whose ack is not sent yet.
func (a *acker) counts() (unsettled, held int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.unsettled), len(a.held)
}

// nack hands one delivery back to the queue, at once.
func (a *acker) nack(tag uint64) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.unsettled, tag)
	a.sent[tag] = struct{}{}
	a.frames++
	err := a.ch.Nack(tag, false, true)
	a.sendCovered()
	if err != nil {
		return err
	}
	return a.takeErr()
}

// flush sends every held ack now: those a multiple-ack can cover in one
// frame, the others one by one. Call it before closing the channel.
func (a *acker) flush() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.flushLocked()
}

func (a *acker) flushLocked() {
	if a.timer != nil {
		a.timer.Stop()
		a.timer = nil
	}
	a.sendCovered()
	rest := make([]uint64, 0, len(a.held))
	for t := range a.held {
		rest = append(rest, t)
	}
	slices.Sort(rest)
	for _, t := range rest {
		a.send(t, false)
		a.sent[t] = struct{}{}
	}
	clear(a.held)
}

// sendCovered advances low past settled tags and sends one multiple-ack for
// the held tags below it. It stops at a tag in progress and at a tag never
// registered.
func (a *acker) sendCovered() {
	for a.low <= a.high {
		if _, ok := a.held[a.low]; ok {
			a.low++
			continue
		}
		if _, ok := a.sent[a.low]; ok {
			delete(a.sent, a.low)
			a.low++
			continue
		}
		break
	}
	var upTo uint64
	for t := range a.held {
		if t < a.low {
			upTo = max(upTo, t)
			delete(a.held, t)
		}
	}
	if upTo > 0 {
		a.send(upTo, true)
	}
}

func (a *acker) send(tag uint64, multiple bool) {
	a.frames++
	if err := a.ch.Ack(tag, multiple); err != nil && a.err == nil {
		a.err = err
	}
}

func (a *acker) takeErr() error {
	err := a.err
	a.err = nil
	return err
}
