package payments

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/outbox"
)

// TypeReceiptRequested is the message a payment sends through the outbox
// (Handler.Receipts) and Receipts applies.
const TypeReceiptRequested = "RECEIPT_REQUESTED"

// ReasonMissingMessageID dead-letters a RECEIPT_REQUESTED without an AMQP
// message ID: the ID is the message's identity.
const ReasonMissingMessageID = "missing_message_id"

// Receipt is a RECEIPT_REQUESTED message's body: the payment it is for.
type Receipt struct {
	// EventID is the message's ID (not in the body).
	EventID   string `json:"-"`
	Type      string `json:"type"`
	PaymentID string `json:"paymentId"`
	UserID    string `json:"userId"`
	Amount    int64  `json:"amount"`
}

// receiptMessage is the outbox message that asks for ev's receipt.
func receiptMessage(to string, ev Event) outbox.Message {
	body, _ := json.Marshal(Receipt{Type: TypeReceiptRequested, PaymentID: ev.EventID, UserID: ev.UserID, Amount: ev.Amount}) // strings and an int
	return outbox.Message{EventID: ev.EventID, To: to, Key: ev.UserID, Type: TypeReceiptRequested, Body: body}
}

// Receipts applies RECEIPT_REQUESTED messages: one row in receipts each.
// Its event ID is the message's AMQP message ID, which the relay derives
// from the payment (outbox.ID), so a re-published request is a duplicate.
// With Emit set, each receipt also sends a POST of itself through the
// outbox to that destination (an e-mail API, say). It implements
// consumer.Handler[Receipt] and consumer.BatchHandler[Receipt].
type Receipts struct {
	// Emit names the destination each receipt is POSTed to; empty: none.
	Emit string
}

var (
	_ consumer.Handler[Receipt]      = Receipts{}
	_ consumer.BatchHandler[Receipt] = Receipts{}
)

// Reasons lists the handler's dead-letter reasons.
func (Receipts) Reasons() []string {
	return []string{ReasonInvalidJSON, ReasonInvalidField, ReasonUnknownType, ReasonMissingMessageID}
}

// Decode implements consumer.Handler: strict JSON, the message ID as the
// event ID, the AMQP timestamp (the outbox row's time) as the event's time.
func (Receipts) Decode(m consumer.Message) (guard.Event, Receipt, error) {
	if m.ID == "" {
		return guard.Event{}, Receipt{}, consumer.Reject(ReasonMissingMessageID, errors.New("a RECEIPT_REQUESTED needs the AMQP message-id property"))
	}
	var r Receipt
	dec := json.NewDecoder(bytes.NewReader(m.Body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&r); err != nil || dec.More() {
		return guard.Event{ID: m.ID}, Receipt{}, consumer.Reject(ReasonInvalidJSON, fmt.Errorf("receipt body: %v", err))
	}
	switch {
	case r.Type != TypeReceiptRequested:
		return guard.Event{ID: m.ID}, Receipt{}, consumer.Reject(ReasonUnknownType, fmt.Errorf("type %q", truncate(r.Type, 64)))
	case r.PaymentID == "" || r.UserID == "" || len(r.UserID) > MaxUserIDLen:
		return guard.Event{ID: m.ID}, Receipt{}, consumer.Reject(ReasonInvalidField, errors.New("paymentId and userId are required"))
	}
	r.EventID = m.ID
	ev := guard.Event{ID: m.ID, Hash: guard.HashFields(r.PaymentID, r.UserID, strconv.FormatInt(r.Amount, 10)), Time: m.Timestamp, ShardKey: r.UserID}
	return ev, r, nil
}

// Apply implements consumer.Handler.
func (h Receipts) Apply(ctx context.Context, tx pgx.Tx, r Receipt) error {
	return h.ApplyBatch(ctx, tx, []Receipt{r})
}

const applyReceipts = `INSERT INTO receipts (event_id, payment_id, user_id, amount)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[])`

// ApplyBatch implements consumer.BatchHandler: one statement for the
// receipts, one for their outgoing POSTs.
func (h Receipts) ApplyBatch(ctx context.Context, tx pgx.Tx, rs []Receipt) error {
	ids, payments, users := make([]string, len(rs)), make([]string, len(rs)), make([]string, len(rs))
	amounts := make([]int64, len(rs))
	for i, r := range rs {
		ids[i], payments[i], users[i], amounts[i] = r.EventID, r.PaymentID, r.UserID, r.Amount
	}
	if _, err := tx.Exec(ctx, applyReceipts, ids, payments, users, amounts); err != nil {
		return fmt.Errorf("apply %d receipts: %w", len(rs), err)
	}
	if h.Emit == "" {
		return nil
	}
	msgs := make([]outbox.Message, len(rs))
	for i, r := range rs {
		body, _ := json.Marshal(r)
		msgs[i] = outbox.Message{EventID: r.EventID, To: h.Emit, Key: r.UserID, Type: "RECEIPT", Body: body}
	}
	return outbox.Enqueue(ctx, tx, msgs...)
}
