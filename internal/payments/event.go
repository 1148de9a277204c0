// Package payments is the reference handler: PAYMENT_COMPLETED events append
// to payments_ledger and add to account_balances. The handler is not
// idempotent by itself (payments_ledger has no unique key on event_id), so
// the guard alone stands between a redelivery and a double payment.
package payments

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
)

// TypePaymentCompleted is the one event type the reference handler applies.
const TypePaymentCompleted = "PAYMENT_COMPLETED"

// MaxUserIDLen bounds userId, in bytes.
const MaxUserIDLen = 128

// Dead-letter reasons for bad input.
const (
	ReasonInvalidJSON    = "invalid_json"
	ReasonInvalidEventID = "invalid_event_id"
	ReasonInvalidField   = "invalid_field"
	ReasonUnknownType    = "unknown_type"
)

// Event is the message body: {"eventId","userId","type","amount"}.
type Event struct {
	EventID string `json:"eventId"`
	UserID  string `json:"userId"`
	Type    string `json:"type"`
	Amount  int64  `json:"amount"`
}

// wire is Event as decoded, with fields that can be absent or mistyped left
// raw so that each mistake gets its own message.
type wire struct {
	EventID *string          `json:"eventId"`
	UserID  *string          `json:"userId"`
	Type    *string          `json:"type"`
	Amount  *json.RawMessage `json:"amount"`
}

// Decode parses and validates a message body. Every error is a
// consumer.Reject with one of the Reason constants.
func Decode(body []byte) (Event, error) {
	var w wire
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(&w); err != nil {
		var typeErr *json.UnmarshalTypeError
		if errors.As(err, &typeErr) && typeErr.Field != "" {
			return Event{}, fieldErr(typeErr.Field, "want a %s, got %s", typeErr.Type, typeErr.Value)
		}
		return Event{}, consumer.Reject(ReasonInvalidJSON, err)
	}
	if dec.More() {
		return Event{}, consumer.Reject(ReasonInvalidJSON, errors.New("trailing data after the JSON object"))
	}
	if w.EventID == nil {
		return Event{}, consumer.Reject(ReasonInvalidEventID, errors.New("eventId is missing"))
	}
	if err := guard.ValidateID(*w.EventID); err != nil {
		return Event{}, consumer.Reject(ReasonInvalidEventID, err)
	}
	ev := Event{EventID: *w.EventID}
	if w.UserID == nil || *w.UserID == "" {
		return Event{}, fieldErr("userId", "missing or empty")
	}
	if len(*w.UserID) > MaxUserIDLen {
		return Event{}, fieldErr("userId", "%d bytes, limit %d", len(*w.UserID), MaxUserIDLen)
	}
	ev.UserID = *w.UserID
	if w.Type == nil {
		return Event{}, fieldErr("type", "missing")
	}
	if *w.Type != TypePaymentCompleted {
		return Event{}, consumer.Reject(ReasonUnknownType, fmt.Errorf("type %q is not %s", *w.Type, TypePaymentCompleted))
	}
	ev.Type = *w.Type
	if w.Amount == nil {
		return Event{}, fieldErr("amount", "missing")
	}
	amount, err := parseAmount(*w.Amount)
	if err != nil {
		return Event{}, fieldErr("amount", "%v", err)
	}
	ev.Amount = amount
	return ev, nil
}

// parseAmount accepts a JSON integer in [1, 2^53): minor units (cents), so
// no fractions and no exponents. The upper bound keeps the amount exact in
// every JSON reader.
func parseAmount(raw json.RawMessage) (int64, error) {
	s := string(raw)
	if strings.HasPrefix(s, `"`) {
		return 0, fmt.Errorf("want an integer, got a string %s", s)
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("want an integer in minor units, got %s", s)
	}
	if n <= 0 || n >= 1<<53 {
		return 0, fmt.Errorf("want 1 to 2^53-1, got %d", n)
	}
	return n, nil
}

func fieldErr(field, format string, args ...any) error {
	return consumer.Reject(ReasonInvalidField, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...)))
}

// Hash fingerprints the event's content independently of JSON formatting and
// key order, so a re-send is a duplicate and a changed payload a conflict.
func (e Event) Hash() []byte {
	return guard.HashFields(e.EventID, e.UserID, e.Type, strconv.FormatInt(e.Amount, 10))
}

// Marshal encodes the event as a message body.
func (e Event) Marshal() []byte {
	b, _ := json.Marshal(e) // cannot fail: strings and an int
	return b
}
