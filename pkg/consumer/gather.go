package consumer

import (
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// busyLinger is how many BatchLingers a batch that is not full may wait while
// another batch is in flight. A worker that is free while the other works
// would otherwise take small batches; waiting lets it take fuller ones, and
// the wait is bounded.
const busyLinger = 3

// intake takes each delivery from the library as it arrives, registers it
// with the acker, and queues it for gather, which takes what is queued in
// bulk while it has room for a batch: one hand-off between goroutines per
// delivery (the library's), not two. A delivery the broker sent counts as
// unacked from then on (Stats.InFlight, Stats.Unacked), as the broker
// counts it, not only once a batch takes it. The broker's prefetch bounds
// the queue. The queue closes once deliveries is closed.
func (w *worker[T]) intake(deliveries <-chan amqp.Delivery) *intakeQueue {
	q := &intakeQueue{ready: make(chan struct{}, 1)}
	go func() {
		for d := range deliveries {
			w.acker.register(d.DeliveryTag)
			q.push(d)
		}
		// The consume channel is gone (the session failed): the broker
		// has every delivery back, and no ack of these can land. Drop
		// them rather than process them for nothing.
		c, ok := w.acker.ch.(interface{ IsClosed() bool })
		q.close(ok && c.IsClosed())
	}()
	return q
}

// intakeQueue is what intake queued and gather has not taken.
type intakeQueue struct {
	ready chan struct{} // holds a value while something is queued, or once closed

	mu     sync.Mutex
	queue  []amqp.Delivery // queue[head:] is queued
	head   int
	closed bool
}

func (q *intakeQueue) push(d amqp.Delivery) {
	q.mu.Lock()
	if q.head > 0 && q.head >= cap(q.queue)/2 {
		// Taken slots fill half the array: move what is queued to its
		// front rather than grow it (each slot is moved at most once
		// per halving, so a push costs O(1) on average).
		n := copy(q.queue, q.queue[q.head:])
		clear(q.queue[n:])
		q.queue, q.head = q.queue[:n], 0
	}
	q.queue = append(q.queue, d)
	q.mu.Unlock()
	q.signal()
}

// close ends the queue; with drop, what it holds goes too.
func (q *intakeQueue) close(drop bool) {
	q.mu.Lock()
	q.closed = true
	if drop {
		clear(q.queue)
		q.queue, q.head = q.queue[:0], 0
	}
	q.mu.Unlock()
	q.signal()
}

func (q *intakeQueue) signal() {
	select {
	case q.ready <- struct{}{}:
	default:
	}
}

// take appends up to n queued deliveries to cur, in the broker's order.
// end reports that the queue is closed and nothing is left in it.
func (q *intakeQueue) take(cur []amqp.Delivery, n int) (_ []amqp.Delivery, end bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	k := min(n, len(q.queue)-q.head)
	cur = append(cur, q.queue[q.head:q.head+k]...)
	clear(q.queue[q.head : q.head+k]) // let the taken bodies go
	q.head += k
	rest := len(q.queue) - q.head
	if rest == 0 {
		q.queue, q.head = q.queue[:0], 0
	}
	if rest > 0 || q.closed {
		q.signal() // more to take, or the end to see, once there is room
	}
	return cur, q.closed && rest == 0
}

// gather reads deliveries (registered by intake) and hands them to the
// workers in batches. A batch goes as soon as it
// is full; one that is not full goes once its first delivery has waited
// Config.BatchLinger with no batch in flight, or busyLinger times that while
// others are, and a worker is free. With BatchSize 1 every delivery goes on
// its own. done receives one value per batch a worker finished.
func (w *worker[T]) gather(in *intakeQueue, batches chan<- []amqp.Delivery, done <-chan struct{}) {
	defer close(batches)
	size, linger := w.c.cfg.BatchSize, w.c.cfg.BatchLinger
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	var cur []amqp.Delivery
	var first time.Time // when cur's first delivery arrived
	inFlight := 0
	for {
		var out chan<- []amqp.Delivery
		if n := len(cur); n > 0 {
			waited := time.Since(first)
			switch {
			case n >= size, inFlight == 0 && waited >= linger, waited >= busyLinger*linger:
				out = batches
			case inFlight == 0:
				timer.Reset(linger - waited)
			default:
				timer.Reset(busyLinger*linger - waited)
			}
		}
		read := in.ready
		if len(cur) >= size {
			read = nil // full: wait for a worker
		}
		select {
		case <-read:
			had := len(cur)
			var end bool
			if cur, end = in.take(cur, size-len(cur)); end {
				if len(cur) > 0 {
					w.c.cfg.Observer.Gathered(len(cur))
					batches <- cur
				}
				return
			}
			if had == 0 && len(cur) > 0 {
				first = time.Now()
			}
		case out <- cur:
			w.c.cfg.Observer.Gathered(len(cur))
			cur = nil
			inFlight++
			timer.Stop()
		case <-done:
			inFlight--
		case <-timer.C:
		}
	}
}
