package outbox_test

import (
	"context"
	"encoding/json"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/pkg/outbox"
)

// shipment is an event of a service's own.
type shipment struct {
	ID, Order, Customer string
}

// shipments records a shipment and, in the same transaction, asks two
// other systems to act on it: the notifications service's queue and a
// carrier's HTTP API (destinations the relay's outbox.destinations names).
type shipments struct{}

func (shipments) Apply(ctx context.Context, tx pgx.Tx, s shipment) error {
	if _, err := tx.Exec(ctx, `INSERT INTO shipments (event_id, order_id) VALUES ($1, $2)`, s.ID, s.Order); err != nil {
		return err
	}
	body, _ := json.Marshal(s)
	// Index 0 and 1: the same two messages on every attempt, so a
	// re-publish is the same message (outbox.ID) to its receiver.
	return outbox.Enqueue(ctx, tx,
		outbox.Message{EventID: s.ID, Index: 0, To: "notifications", Key: s.Customer, Type: "SHIPPED", Body: body},
		outbox.Message{EventID: s.ID, Index: 1, To: "carrier", Key: s.Order, Body: body},
	)
}

// A handler sends messages to other systems by enqueueing them in the
// transaction it was given: they exist if and only if its effect commits,
// and a relay (idem relay) publishes them afterwards.
func ExampleEnqueue() {
	var h shipments
	_ = h.Apply // called by the consumer with the event's transaction
}
