package consumer

import (
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// busyLinger is how many BatchLingers a batch that is not full may wait while
// another batch is in flight. A worker that is free while the other works
// would otherwise take small batches; waiting lets it take fuller ones, and
// the wait is bounded.
const busyLinger = 3

// intake takes each delivery from the library as it arrives, registers it
// with the acker, and queues it for gather, which reads only while it has
// room for a batch. A delivery the broker sent counts as unacked from then
// on (Stats.InFlight, Stats.Unacked), as the broker counts it, not only once
// a batch takes it. The broker's prefetch bounds the queue. The returned
// channel closes once deliveries is closed and everything queued was taken.
func (w *worker[T]) intake(deliveries <-chan amqp.Delivery) <-chan amqp.Delivery {
	out := make(chan amqp.Delivery)
	go func() {
		defer close(out)
		var queue []amqp.Delivery
		in := deliveries
		for in != nil || len(queue) > 0 {
			var send chan<- amqp.Delivery
			var next amqp.Delivery
			if len(queue) > 0 {
				send, next = out, queue[0]
			}
			select {
			case d, ok := <-in:
				if !ok {
					in = nil
					if c, ok := w.acker.ch.(interface{ IsClosed() bool }); ok && c.IsClosed() {
						// The consume channel is gone (the session
						// failed): the broker has every delivery back,
						// and no ack of these can land. Drop them
						// rather than process them for nothing.
						queue = nil
					}
					continue
				}
				w.acker.register(d.DeliveryTag)
				queue = append(queue, d)
			case send <- next:
				queue[0] = amqp.Delivery{} // let its body go
				queue = queue[1:]
			}
		}
	}()
	return out
}

// gather reads deliveries (registered by intake) and hands them to the
// workers in batches. A batch goes as soon as it
// is full; one that is not full goes once its first delivery has waited
// Config.BatchLinger with no batch in flight, or busyLinger times that while
// others are, and a worker is free. With BatchSize 1 every delivery goes on
// its own. done receives one value per batch a worker finished.
func (w *worker[T]) gather(deliveries <-chan amqp.Delivery, batches chan<- []amqp.Delivery, done <-chan struct{}) {
	defer close(batches)
	size, linger := w.c.cfg.BatchSize, w.c.cfg.BatchLinger
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	var cur []amqp.Delivery
	var first time.Time // when cur's first delivery arrived
	inFlight := 0
	in := deliveries
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
		read := in
		if len(cur) >= size {
			read = nil // full: wait for a worker
		}
		select {
		case d, ok := <-read:
			if !ok {
				if len(cur) > 0 {
					w.c.cfg.Observer.Gathered(len(cur))
					batches <- cur
				}
				return
			}
			if len(cur) == 0 {
				first = time.Now()
			}
			cur = append(cur, d)
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
