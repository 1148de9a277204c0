package payments

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/outbox"
)

// Handler applies payment events. It implements consumer.Handler[Event].
type Handler struct {
	// Receipts, if set, names the outbox destination each payment sends a
	// RECEIPT_REQUESTED to, in the payment's transaction.
	Receipts string
}

var _ consumer.Handler[Event] = Handler{}

// Decode implements consumer.Handler. The event's time is its occurredAt;
// without one the consumer uses the AMQP timestamp.
func (Handler) Decode(m consumer.Message) (guard.Event, Event, error) {
	ev, err := Decode(m.Body)
	if err != nil {
		return guard.Event{ID: ev.EventID}, Event{}, err // the ID, if it was read, names the dead letter
	}
	// The user is the shard key: a payment writes its ledger row and its
	// balance, both keyed by the user, on the shard that holds its dedup row.
	return guard.Event{ID: ev.EventID, Hash: ev.Hash(), Time: ev.OccurredAt, ShardKey: ev.UserID}, ev, nil
}

// Apply appends the payment to the ledger and adds it to the balance, both
// through tx, which also holds the event's dedup row.
func (h Handler) Apply(ctx context.Context, tx pgx.Tx, ev Event) error {
	b := &pgx.Batch{}
	b.Queue(`INSERT INTO payments_ledger (event_id, user_id, amount) VALUES ($1, $2, $3)`, ev.EventID, ev.UserID, ev.Amount)
	b.Queue(`INSERT INTO account_balances (user_id, balance) VALUES ($1, $2)
		ON CONFLICT (user_id) DO UPDATE SET balance = account_balances.balance + EXCLUDED.balance, updated_at = now()`,
		ev.UserID, ev.Amount)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("apply payment %s: %w", ev.EventID, err)
	}
	if h.Receipts == "" {
		return nil
	}
	return outbox.Enqueue(ctx, tx, receiptMessage(h.Receipts, ev))
}

var _ consumer.BatchHandler[Event] = Handler{}

// applyLedger appends the batch's payments in one statement.
const applyLedger = `INSERT INTO payments_ledger (event_id, user_id, amount)
SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])`

// applyBalances adds each user's total to their balance, one row per user,
// locked in user ID order so that two batches cannot deadlock. The sum is
// numeric, so a total past bigint fails the cast (22003) as one event's
// overflow would, and the consumer splits the batch down to that event.
const applyBalances = `INSERT INTO account_balances (user_id, balance)
SELECT user_id, sum(amount)::bigint FROM unnest($1::text[], $2::bigint[]) AS t(user_id, amount)
GROUP BY user_id ORDER BY user_id
ON CONFLICT (user_id) DO UPDATE SET balance = account_balances.balance + EXCLUDED.balance, updated_at = now()`

// ApplyBatch implements consumer.BatchHandler: the same effect as Apply for
// each event, in two set-based statements sent in one round trip.
func (h Handler) ApplyBatch(ctx context.Context, tx pgx.Tx, evs []Event) error {
	ids := make([]string, len(evs))
	users := make([]string, len(evs))
	amounts := make([]int64, len(evs))
	for i, ev := range evs {
		ids[i], users[i], amounts[i] = ev.EventID, ev.UserID, ev.Amount
	}
	b := &pgx.Batch{}
	b.Queue(applyLedger, ids, users, amounts)
	b.Queue(applyBalances, users, amounts)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("apply %d payments: %w", len(evs), err)
	}
	if h.Receipts == "" {
		return nil
	}
	msgs := make([]outbox.Message, len(evs))
	for i, ev := range evs {
		msgs[i] = receiptMessage(h.Receipts, ev)
	}
	return outbox.Enqueue(ctx, tx, msgs...)
}
