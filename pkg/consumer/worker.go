package consumer

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
)

// Headers set on dead-lettered messages.
const (
	HeaderReason        = "x-idem-reason"
	HeaderError         = "x-idem-error"
	HeaderQueue         = "x-idem-queue"
	HeaderDeliveryCount = "x-idem-delivery-count"
)

// maxErrorHeader bounds the error text copied into a dead letter.
const maxErrorHeader = 1024

// worker handles deliveries of one session.
type worker[T any] struct {
	c    *Consumer[T]
	pub  *amqp.Channel   // confirm-mode channel for dead letters
	stop context.Context // ends when shutdown begins or the session fails
}

// handle takes one delivery to a durable outcome and acks it, or leaves it to
// the broker (nack with requeue) when that cannot be reached now.
func (w *worker[T]) handle(ctx context.Context, d amqp.Delivery) {
	cfg := &w.c.cfg
	if cfg.Retention > 0 && !d.Timestamp.IsZero() && time.Since(d.Timestamp) >= cfg.Retention {
		w.deadLetter(ctx, d, ReasonBeyondRetention, errors.New("published longer ago than the dedup retention"))
		return
	}
	ev, v, err := w.c.handler.Decode(d.Body)
	if err != nil {
		reason, ok := rejectReason(err)
		if !ok {
			reason = ReasonDecode
		}
		w.deadLetter(ctx, d, reason, err)
		return
	}
	attempt := deliveryCount(d) + 1
	apply := func(ctx context.Context, tx pgx.Tx) error { return w.c.handler.Apply(ctx, tx, v) }

	for wait := 1; ; wait++ {
		actx, cancel := context.WithTimeout(ctx, cfg.HandlerTimeout)
		outcome, err := w.c.guard.Process(actx, ev, apply)
		cancel()
		switch {
		case err == nil:
			w.ack(ctx, d, outcome, "")
			return
		case errors.Is(err, guard.ErrPayloadConflict):
			w.deadLetter(ctx, d, ReasonPayloadConflict, err)
			return
		case errors.Is(err, guard.ErrInvalidID), errors.Is(err, guard.ErrInvalidEvent):
			w.deadLetter(ctx, d, ReasonInvalidEvent, err)
			return
		case ctx.Err() != nil:
			// Drain timeout: the tx was rolled back; the broker redelivers.
			w.requeue(d, "shutdown")
			return
		}
		if reason, ok := rejectReason(err); ok {
			w.deadLetter(ctx, d, reason, err)
			return
		}
		if isInfra(err) {
			// Postgres is unreachable or restarting: not the event's fault,
			// so hold the delivery and retry in place without spending
			// its delivery budget. Nothing is acked meanwhile.
			delay := cfg.RetryBackoff.Delay(wait)
			cfg.Logger.Warn("store unavailable, retrying in place", "event_id", ev.ID, "attempt", attempt, "err", err, "delay", delay)
			if !sleep(w.stop, delay) {
				w.requeue(d, "shutdown")
				return
			}
			continue
		}
		if attempt >= cfg.DeliveryLimit {
			cfg.Logger.Error("handler failed, dead-lettering", "event_id", ev.ID, "attempt", attempt, "err", err, "delivery_limit", cfg.DeliveryLimit)
			w.deadLetter(ctx, d, ReasonHandlerFailed, err)
			return
		}
		delay := cfg.RetryBackoff.Delay(attempt)
		cfg.Logger.Warn("handler failed, will retry", "event_id", ev.ID, "attempt", attempt, "err", err, "delay", delay)
		sleep(w.stop, delay)
		w.requeue(d, ReasonHandlerFailed)
		return
	}
}

// isInfra reports whether err came from the store being unavailable rather
// than from the event or the handler's logic.
func isInfra(err error) bool {
	var se *guard.StoreError
	return errors.As(err, &se) || pgtier.IsTransient(err)
}

func (w *worker[T]) ack(ctx context.Context, d amqp.Delivery, o guard.Outcome, reason string) {
	w.c.cfg.Hook(ctx, StepBeforeAck)
	if err := d.Ack(false); err != nil {
		// The channel is gone; the broker redelivers and the guard
		// reports a duplicate.
		w.c.cfg.Logger.Warn("ack failed", "err", err, "outcome", o.String())
	}
	w.c.cfg.OnOutcome(o, reason)
}

func (w *worker[T]) requeue(d amqp.Delivery, reason string) {
	if err := d.Nack(false, true); err != nil {
		w.c.cfg.Logger.Warn("nack failed", "err", err)
	}
	w.c.cfg.OnOutcome(guard.OutcomeRetry, reason)
}

// deadLetter publishes d to the dead-letter exchange with its reason, waits
// for the broker's confirm, and only then acks d. Without a confirm the
// delivery is requeued: a dead letter is never acked away unconfirmed.
func (w *worker[T]) deadLetter(ctx context.Context, d amqp.Delivery, reason string, cause error) {
	cfg := &w.c.cfg
	msg := truncate(cause.Error(), maxErrorHeader)
	headers := amqp.Table{}
	for k, v := range d.Headers {
		headers[k] = v
	}
	headers[HeaderReason] = reason
	headers[HeaderError] = msg
	headers[HeaderQueue] = cfg.Queue
	headers[HeaderDeliveryCount] = int64(deliveryCount(d) + 1)

	cctx, cancel := context.WithTimeout(ctx, cfg.ConfirmTimeout)
	defer cancel()
	t := w.c.topology
	dc, err := w.pub.PublishWithDeferredConfirmWithContext(cctx, t.DeadLetterExchange, t.DeadLetterQueue, false, false, amqp.Publishing{
		Headers:      headers,
		ContentType:  d.ContentType,
		DeliveryMode: amqp.Persistent,
		MessageId:    d.MessageId,
		Timestamp:    d.Timestamp,
		Body:         d.Body,
	})
	if err == nil {
		var ok bool
		ok, err = dc.WaitContext(cctx)
		if err == nil && !ok {
			err = errors.New("broker nacked the dead letter")
		}
	}
	if err != nil {
		cfg.Logger.Error("dead-letter publish failed, requeueing", "reason", reason, "err", err)
		w.requeue(d, "dead_letter_unconfirmed")
		return
	}
	cfg.Logger.Warn("dead-lettered", "reason", reason, "err", msg, "message_id", d.MessageId)
	w.ack(ctx, d, guard.OutcomeDeadLettered, reason)
}

// deliveryCount is how many times the broker delivered d before, from the
// quorum queue's x-delivery-count header (absent on the first delivery).
func deliveryCount(d amqp.Delivery) int {
	switch n := d.Headers["x-delivery-count"].(type) {
	case int64:
		return int(n)
	case int32:
		return int(n)
	case int:
		return n
	case int16:
		return int(n)
	case int8:
		return int(n)
	}
	if d.Redelivered {
		return 1
	}
	return 0
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
