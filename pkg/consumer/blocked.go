package consumer

import (
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"
)

// blockState is whether the broker blocks the session's publishing
// connection (connection.blocked: a memory or disk alarm). Dead letters wait
// while it does; acks, on the consume connection, go on.
type blockState struct {
	mu      sync.Mutex
	reason  string        // empty: not blocked
	cleared chan struct{} // closed when the block ends; nil when not blocked
}

// set records a connection.blocked or connection.unblocked notification.
func (b *blockState) set(n amqp.Blocking) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case n.Active && b.cleared == nil:
		b.reason, b.cleared = n.Reason, make(chan struct{})
	case n.Active:
		b.reason = n.Reason
	case b.cleared != nil:
		close(b.cleared)
		b.reason, b.cleared = "", nil
	}
}

// state returns why publishing is blocked ("" if it is not) and a channel
// closed when the block ends (nil if it is not blocked).
func (b *blockState) state() (string, <-chan struct{}) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.reason, b.cleared
}
