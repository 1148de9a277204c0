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
	// error is dead-lettered as ReasonDecode. Set the guard.Event's Time
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

// Dead-letter reasons set by the runtime. Handlers add their own through Reject.
const (
	ReasonDecode          = "decode_error"
	ReasonPayloadConflict = "payload_conflict"
	// ReasonHandlerFailed: Apply kept failing for Config.DeliveryLimit attempts.
	ReasonHandlerFailed = "handler_failed"
	// ReasonHandlerTimeout: attempts kept outlasting Config.HandlerTimeout.
	ReasonHandlerTimeout = "handler_timeout"
	// ReasonCommitFailed: COMMIT kept failing for a reason of the
	// transaction's own (a statement Apply let fail aborted it, say).
	ReasonCommitFailed = "commit_failed"
	// ReasonStoreFailed: the store kept refusing the dedup row's
	// transaction while reachable (a missing table, a permission).
	ReasonStoreFailed = "store_failed"
	// ReasonDataException: a PostgreSQL data error (SQLSTATE class 22,
	// other than an overflow): the same input fails every time.
	ReasonDataException = "data_exception"
	// ReasonNumericOverflow: SQLSTATE 22003, a value out of its column's
	// range (a balance past bigint, say).
	ReasonNumericOverflow = "numeric_overflow"
	// ReasonIntegrityViolation: SQLSTATE class 23, from Apply's statements
	// or a deferred constraint checked at COMMIT.
	ReasonIntegrityViolation = "integrity_violation"
	// ReasonBeyondRetention: the event is older than Config.Retention, or
	// its dedup row was pruned while it was claimed. Its dedup history may
	// be gone, so applying it could apply it twice.
	ReasonBeyondRetention = "beyond_retention"
	// ReasonFutureTimestamp: the event's time is more than
	// Config.ClockSkew ahead of this consumer's clock.
	ReasonFutureTimestamp = "future_timestamp"
	// ReasonMissingTime: the event carries no time (neither in its payload
	// nor as an AMQP timestamp) and Config.Untimed is UntimedReject.
	ReasonMissingTime = "missing_time"
	// ReasonInvalidEvent: Decode returned an event the guard cannot take
	// (a bad ID or an empty hash); a bug in the handler's Decode.
	ReasonInvalidEvent = "invalid_event"
	// ReasonDeliveryLimit is set by the broker (x-death), not by a consumer:
	// the message exceeded the queue's x-delivery-limit, for instance
	// because it crashed every consumer that took it.
	ReasonDeliveryLimit = "delivery_limit"
)

// Reasons lists the dead-letter reasons the runtime and the broker write. A
// handler's Decode and Apply add their own through Reject.
func Reasons() []string {
	return []string{ReasonDecode, ReasonPayloadConflict, ReasonHandlerFailed, ReasonHandlerTimeout, ReasonCommitFailed,
		ReasonStoreFailed, ReasonDataException, ReasonNumericOverflow, ReasonIntegrityViolation, ReasonBeyondRetention,
		ReasonFutureTimestamp, ReasonMissingTime, ReasonInvalidEvent, ReasonDeliveryLimit}
}

// Reasons a delivery goes back to the queue (OutcomeRetry) rather than to
// the dead-letter queue.
const (
	// RequeueStoreUnavailable: Postgres stayed unreachable for
	// Config.StoreHold, so the delivery is handed back to the broker.
	RequeueStoreUnavailable = "store_unavailable"
	// RequeueUnroutable: the dead-letter queue was missing, so the
	// dead letter could not be routed; the consumer re-declares it and
	// the delivery comes back.
	RequeueUnroutable = "dead_letter_unroutable"
	// RequeueUnconfirmed: the broker did not confirm the dead letter.
	RequeueUnconfirmed = "dead_letter_unconfirmed"
	// RequeuePublishBlocked: the broker blocked publishing (a memory or
	// disk alarm) for Config.StoreHold while the dead letter waited.
	RequeuePublishBlocked = "publish_blocked"
	// RequeueShutdown: the consumer stopped before the delivery's outcome.
	RequeueShutdown = "shutdown"
	// RequeueNoOutcome: the guard returned no outcome for the delivery,
	// which it never should; it is handed back rather than acked.
	RequeueNoOutcome = "no_outcome"
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
