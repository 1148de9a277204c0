package payments

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
)

// Handler applies payment events. It implements consumer.Handler[Event].
type Handler struct{}

var _ consumer.Handler[Event] = Handler{}

// Decode implements consumer.Handler. The event's time is its occurredAt;
// without one the consumer uses the AMQP timestamp.
func (Handler) Decode(m consumer.Message) (guard.Event, Event, error) {
	ev, err := Decode(m.Body)
	if err != nil {
		return guard.Event{}, Event{}, err
	}
	return guard.Event{ID: ev.EventID, Hash: ev.Hash(), Time: ev.OccurredAt}, ev, nil
}

// Apply appends the payment to the ledger and adds it to the balance, both
// through tx, which also holds the event's dedup row.
func (Handler) Apply(ctx context.Context, tx pgx.Tx, ev Event) error {
	b := &pgx.Batch{}
	b.Queue(`INSERT INTO payments_ledger (event_id, user_id, amount) VALUES ($1, $2, $3)`, ev.EventID, ev.UserID, ev.Amount)
	b.Queue(`INSERT INTO account_balances (user_id, balance) VALUES ($1, $2)
		ON CONFLICT (user_id) DO UPDATE SET balance = account_balances.balance + EXCLUDED.balance, updated_at = now()`,
		ev.UserID, ev.Amount)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("apply payment %s: %w", ev.EventID, err)
	}
	return nil
}
