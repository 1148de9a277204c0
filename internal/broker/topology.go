package broker

import (
	"fmt"
	"slices"
	"strconv"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/pkg/partition"
)

// DefaultDeliveryLimit is a queue's x-delivery-limit unless configured
// (consumer.Config.BrokerDeliveryLimit).
const DefaultDeliveryLimit = 20

// Topology names what a consumer declares. Every member of a fleet must
// declare it identically; RabbitMQ refuses a redeclaration with other
// arguments (PRECONDITION_FAILED).
type Topology struct {
	// Queue is the durable quorum queue the events arrive on; with
	// Partitions above 1, the name the partition queues share.
	Queue string
	// Partitions is how many quorum queues the stream is split over, each
	// with its own leader, so that throughput is not bounded by one
	// queue's: Queue.0 to Queue.<Partitions-1>. An event goes to the queue
	// of partition.Of(key, Partitions) for its partition key, so that the
	// events of one key reach one queue in the order they were published
	// (applied in that order only with consumer.Config.KeyOrder and one consumer
	// per partition). 0 or 1: one queue, named Queue.
	Partitions int
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

// TopologyFor names the dead-letter exchange and queue after queue. A zero
// brokerDeliveryLimit is Config's default.
func TopologyFor(queue string, brokerDeliveryLimit int) Topology {
	if brokerDeliveryLimit == 0 {
		brokerDeliveryLimit = DefaultDeliveryLimit
	}
	return Topology{
		Queue:               queue,
		DeadLetterExchange:  queue + ".dlx",
		DeadLetterQueue:     queue + ".dlq",
		BrokerDeliveryLimit: brokerDeliveryLimit,
	}
}

// Queues returns the work queues: Queue, or one per partition.
func (t Topology) Queues() []string {
	if t.Partitions < 2 {
		return []string{t.Queue}
	}
	out := make([]string, t.Partitions)
	for p := range out {
		out[p] = t.PartitionQueue(p)
	}
	return out
}

// MaxStrayPartition bounds the partition queues Strays looks for beyond the
// stream's count: none numbered at or above it (1024, the most partitions
// a relay's queue destination may name).
const MaxStrayPartition = 1024

// Strays returns the queues of the stream outside its layout that a
// publisher may still send to: Queue itself while the stream is
// partitioned (it was one queue once), the queues of the former partition
// count (0: none) that the current one lacks, and, for a publisher outside
// idem configured with a larger count (nothing records its count), the
// partition queues numbered from the current count n (0 for one queue) up
// to max(2n, n+8), below MaxStrayPartition. Nobody consumes them; a message
// there is stranded.
func (t Topology) Strays(former int) []string {
	current := t.Queues()
	old := t
	old.Partitions = former
	candidates := []string{t.Queue}
	if former > 0 {
		candidates = append(candidates, old.Queues()...)
	}
	n := max(t.Partitions, 1)
	wider := t
	wider.Partitions = min(max(2*n, n+8), MaxStrayPartition)
	if wider.Partitions > n {
		candidates = append(candidates, wider.Queues()...)
	}
	var out []string
	for _, q := range candidates {
		if !slices.Contains(current, q) && !slices.Contains(out, q) {
			out = append(out, q)
		}
	}
	return out
}

// PartitionQueue returns the queue of partition p (Queue itself when the
// stream is not partitioned).
func (t Topology) PartitionQueue(p int) string {
	if t.Partitions < 2 {
		return t.Queue
	}
	return t.Queue + "." + strconv.Itoa(p)
}

// QueueFor returns the queue an event with partition key key goes to.
func (t Topology) QueueFor(key string) string {
	return t.PartitionQueue(partition.Of(key, t.Partitions))
}

// DeclareDeadLetter creates the dead-letter exchange and queue, bound, if
// they do not exist: what a session's publishing connection needs, and
// only that. It leaves the work queues alone, so that a publishing
// connection never declares again a queue deleted a moment before (while
// the broker was still cancelling its consumer: RabbitMQ 3.10 then left
// that consumer registered on a queue that delivered nothing).
func (t Topology) DeclareDeadLetter(ch *amqp.Channel) error {
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
	return nil
}

// Declare creates the exchange and queues if they do not exist. It is
// idempotent and safe to run from every consumer and publisher at start.
// Every partition shares the one dead-letter queue.
func (t Topology) Declare(ch *amqp.Channel) error {
	if err := t.DeclareDeadLetter(ch); err != nil {
		return err
	}
	for _, q := range t.Queues() {
		if _, err := ch.QueueDeclare(q, true, false, false, false, amqp.Table{
			amqp.QueueTypeArg:           amqp.QueueTypeQuorum,
			"x-delivery-limit":          int64(t.BrokerDeliveryLimit),
			"x-dead-letter-exchange":    t.DeadLetterExchange,
			"x-dead-letter-routing-key": t.DeadLetterQueue,
			"x-dead-letter-strategy":    "at-least-once",
			"x-overflow":                "reject-publish",
		}); err != nil {
			return fmt.Errorf("declare queue %q (if it exists with other arguments, match the config or delete it): %w", q, err)
		}
	}
	return nil
}
