package consumer

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/pkg/guard"
)

// Handler decodes and applies events of type T.
type Handler[T any] interface {
	// Decode parses and validates a message body. An error dead-letters the
	// delivery: return Reject(reason, err) to name the reason; any other
	// error is dead-lettered as ReasonDecode.
	Decode(body []byte) (guard.Event, T, error)
	// Apply performs the event's effect through tx, which also holds the
	// event's dedup row. Return Reject(reason, err) for an event that can
	// never succeed; any other error is retried with backoff and
	// dead-lettered as ReasonHandlerFailed after Config.DeliveryLimit attempts.
	Apply(ctx context.Context, tx pgx.Tx, v T) error
}

// Dead-letter reasons set by the runtime. Handlers add their own through Reject.
const (
	ReasonDecode          = "decode_error"
	ReasonPayloadConflict = "payload_conflict"
	ReasonHandlerFailed   = "handler_failed"
	ReasonBeyondRetention = "beyond_retention"
	// ReasonInvalidEvent: Decode returned an event the guard cannot take
	// (a bad ID or an empty hash); a bug in the handler's Decode.
	ReasonInvalidEvent = "invalid_event"
	// ReasonDeliveryLimit is set by the broker (x-death), not by a consumer:
	// the message exceeded the queue's x-delivery-limit, for instance
	// because it crashed every consumer that took it.
	ReasonDeliveryLimit = "delivery_limit"
)

// RejectError marks an error as permanent: the delivery is dead-lettered with
// Reason at once instead of being retried.
type RejectError struct {
	Reason string
	Err    error
}

func (e *RejectError) Error() string { return fmt.Sprintf("%s: %v", e.Reason, e.Err) }
func (e *RejectError) Unwrap() error { return e.Err }

// Reject returns a permanent error that dead-letters the delivery with reason
// (a short snake_case word, used in headers and metrics).
func Reject(reason string, err error) error {
	return &RejectError{Reason: reason, Err: err}
}

// rejectReason returns the reason of a RejectError in err's chain.
func rejectReason(err error) (string, bool) {
	var re *RejectError
	if errors.As(err, &re) {
		return re.Reason, true
	}
	return "", false
}
