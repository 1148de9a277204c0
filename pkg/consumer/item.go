package consumer

import (
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/pkg/guard"
)

// item is a delivery that decoded into an event the guard can take.
type item[T any] struct {
	d  amqp.Delivery
	ev guard.Event
	v  T
	// deferred: the item was set aside once because another consumer held
	// its lease; the next screening sends it to the store whatever it finds.
	deferred bool
	// received is when the consumer took the delivery.
	received time.Time
}
