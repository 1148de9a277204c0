package consumer

import (
	"sync"
	"sync/atomic"
)

// confirmShard is one shard's confirm queue: the settling of each batch
// of duplicates, which reports whether it must run again (the store did not
// answer, and the batch is held), and whether the store answered the last;
// and the duplicates it confirmed, which ackStage acks together.
type confirmShard[T any] struct {
	queue      *confirmQueue[func() (again bool)]
	unanswered atomic.Bool
	acks       *confirmQueue[item[T]]
}

func newConfirmShard[T any]() *confirmShard[T] {
	return &confirmShard[T]{queue: newConfirmQueue[func() bool](), acks: newConfirmQueue[item[T]]()}
}

// confirmQueue is a confirm shard's queue, taken whole by one goroutine: of
// the batches whose every event (deferred ones aside) the fast tier knows as
// done, until the store confirms the history their markers name
// (guard.Confirm), and of the duplicates so confirmed, until they are acked.
// The screen stage and the deciders add batches and never wait: a duplicate
// costs the pipeline one Redis round trip, and its ack waits for a history
// read shared by every batch screened before that read was sent. Everything
// in it holds unacked deliveries, so the broker's prefetch bounds it.
type confirmQueue[E any] struct {
	mu     sync.Mutex
	queue  []E
	wake   chan struct{} // a value when queue is not empty or closed
	closed bool
}

func newConfirmQueue[E any]() *confirmQueue[E] {
	return &confirmQueue[E]{wake: make(chan struct{}, 1)}
}

// add queues s, together: a taker takes them all or none. It never blocks.
func (q *confirmQueue[E]) add(s ...E) {
	q.mu.Lock()
	q.queue = append(q.queue, s...)
	q.mu.Unlock()
	q.signal()
}

// close says nothing more will be added.
func (q *confirmQueue[E]) close() {
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
	q.signal()
}

func (q *confirmQueue[E]) signal() {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// takeNow returns every queued batch, without waiting.
func (q *confirmQueue[E]) takeNow() []E {
	q.mu.Lock()
	defer q.mu.Unlock()
	out := q.queue
	q.queue = nil
	return out
}

// take returns every queued batch, waiting for one; nil once closed and
// empty.
func (q *confirmQueue[E]) take() []E {
	for {
		q.mu.Lock()
		out, closed := q.queue, q.closed
		q.queue = nil
		q.mu.Unlock()
		if len(out) > 0 || closed {
			return out
		}
		<-q.wake
	}
}
