package consumer

import (
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Topology names what a consumer declares. Every member of a fleet must
// declare it identically; RabbitMQ refuses a redeclaration with other
// arguments (PRECONDITION_FAILED).
type Topology struct {
	// Queue is the durable quorum queue the events arrive on.
	Queue string
	// DeadLetterExchange is a durable direct exchange routing to DeadLetterQueue.
	DeadLetterExchange string
	// DeadLetterQueue receives every message the consumers give up on, with
	// an x-idem-reason header, and those the broker gives up on (x-death).
	DeadLetterQueue string
	// BrokerDeliveryLimit is the queue's x-delivery-limit: the broker's
	// backstop for a message that never reaches a consumer's decision (one
	// that kills every consumer that takes it). It dead-letters the message
	// at-least-once, so it is not lost either.
	BrokerDeliveryLimit int
}

// TopologyFor names the dead-letter exchange and queue after queue.
func TopologyFor(queue string, brokerDeliveryLimit int) Topology {
	return Topology{
		Queue:               queue,
		DeadLetterExchange:  queue + ".dlx",
		DeadLetterQueue:     queue + ".dlq",
		BrokerDeliveryLimit: brokerDeliveryLimit,
	}
}

// Declare creates the exchange and queues if they do not exist. It is
// idempotent and safe to run from every consumer and publisher at start.
func (t Topology) Declare(ch *amqp.Channel) error {
	if err := ch.ExchangeDeclare(t.DeadLetterExchange, amqp.ExchangeDirect, true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange %q: %w", t.DeadLetterExchange, err)
	}
	if _, err := ch.QueueDeclare(t.DeadLetterQueue, true, false, false, false, amqp.Table{
		amqp.QueueTypeArg: amqp.QueueTypeQuorum,
	}); err != nil {
		return fmt.Errorf("declare queue %q: %w", t.DeadLetterQueue, err)
	}
	if err := ch.QueueBind(t.DeadLetterQueue, t.DeadLetterQueue, t.DeadLetterExchange, false, nil); err != nil {
		return fmt.Errorf("bind queue %q: %w", t.DeadLetterQueue, err)
	}
	if _, err := ch.QueueDeclare(t.Queue, true, false, false, false, amqp.Table{
		amqp.QueueTypeArg:           amqp.QueueTypeQuorum,
		"x-delivery-limit":          int64(t.BrokerDeliveryLimit),
		"x-dead-letter-exchange":    t.DeadLetterExchange,
		"x-dead-letter-routing-key": t.DeadLetterQueue,
		"x-dead-letter-strategy":    "at-least-once",
		"x-overflow":                "reject-publish",
	}); err != nil {
		return fmt.Errorf("declare queue %q (if it exists with other arguments, match the config or delete it): %w", t.Queue, err)
	}
	return nil
}
