package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/pkg/guard"
)

// Message is what Decode sees of a delivery: its body and the properties a
// producer sets. A service that uses the AMQP message ID as its idempotency
// key returns it as the guard.Event's ID.
type Message struct {
	// ID is the AMQP message-id property; empty if the producer set none.
	ID string
	// Timestamp is the AMQP timestamp property (second precision); zero if
	// the producer set none.
	Timestamp time.Time
	// ContentType is the AMQP content-type property.
	ContentType string
	// Headers are the AMQP headers as the producer set them (the broker may
	// add x-death and x-delivery-count). Read them; do not keep them.
	Headers map[string]any
	// Body is the message body. Do not keep it past Decode.
	Body []byte
}

// Handler decodes and applies events of type T.
type Handler[T any] interface {
	// Decode parses and validates a message. An error dead-letters the
	// delivery: return Reject(reason, err) to name the reason; any other
	// error is dead-lettered as "decode_error". Set the guard.Event's Time
	// when the payload carries the event's time; otherwise the consumer
	// takes Message.Timestamp.
	Decode(m Message) (guard.Event, T, error)
	// Apply performs the event's effect through tx, which also holds the
	// event's dedup row, and honours ctx (Config.HandlerTimeout). Return
	// Reject(reason, err) for an event that can never succeed. A PostgreSQL
	// data error (SQLSTATE class 22) or integrity violation (class 23), from
	// Apply's statements or at COMMIT, is dead-lettered at once too. Any
	// other error is retried with backoff and dead-lettered after
	// Config.DeliveryLimit attempts; so is an attempt that outlasts
	// HandlerTimeout. Apply may run more than once for one event (an
	// attempt that failed or rolled back is tried again); its effect
	// commits at most once, because it commits only with the event's dedup
	// row.
	Apply(ctx context.Context, tx pgx.Tx, v T) error
}

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
