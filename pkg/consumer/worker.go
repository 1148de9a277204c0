package consumer

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/pkg/guard"
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

// HeaderDeadLetterID marks each dead letter so that a basic.return can be
// matched to its publish.
const HeaderDeadLetterID = "x-idem-dead-letter-id"

// worker handles deliveries of one session.
type worker[T any] struct {
	c     *Consumer[T]
	dl    *deadLetterer
	acker *acker
	stop  context.Context // ends when shutdown begins or the session fails
}

// item is a delivery that decoded into an event the guard can take.
type item[T any] struct {
	d  amqp.Delivery
	ev guard.Event
	v  T
	// deferred: the item was set aside once because another consumer held
	// its lease; the next screening sends it to the store whatever it finds.
	deferred bool
}

// deadLetterer publishes dead letters on a confirm-mode channel, one at a
// time: dead letters are rare, and one publish in flight lets a basic.return
// (which the broker sends before the publish's ack) be matched to it.
type deadLetterer struct {
	mu      sync.Mutex
	pub     *amqp.Channel
	returns chan amqp.Return
	seq     uint64
}

// prepare decodes d and checks its time. A delivery that cannot be processed
// is dead-lettered here, and prepare reports false.
func (w *worker[T]) prepare(ctx context.Context, d amqp.Delivery) (item[T], bool) {
	ev, v, err := w.c.handler.Decode(messageOf(d))
	if err == nil {
		err = ev.Validate()
		if err != nil {
			err = Reject(ReasonInvalidEvent, err)
		}
	}
	if err != nil {
		reason, ok := rejectReason(err)
		if !ok {
			reason = ReasonDecode
		}
		w.deadLetter(ctx, d, reason, err)
		return item[T]{}, false
	}
	if ev.Time.IsZero() {
		ev.Time = d.Timestamp
	}
	if reason, err := w.c.checkTime(ev.Time, time.Now()); err != nil {
		w.deadLetter(ctx, d, reason, err)
		return item[T]{}, false
	}
	return item[T]{d: d, ev: ev, v: v}, true
}

// handleOne takes one event to a durable outcome and acks it, or leaves it
// to the broker (nack with requeue) when that cannot be reached now.
func (w *worker[T]) handleOne(ctx context.Context, it item[T]) {
	cfg := &w.c.cfg
	d, ev := it.d, it.ev
	attempt := deliveryCount(d) + 1
	apply := func(ctx context.Context, tx pgx.Tx) error { return w.c.handler.Apply(ctx, tx, it.v) }

	heldSince := time.Now()
	for wait := 1; ; wait++ {
		actx, cancel := context.WithTimeout(ctx, cfg.HandlerTimeout)
		outcome, err := w.c.guard.Process(actx, ev, apply)
		timedOut := errors.Is(actx.Err(), context.DeadlineExceeded)
		cancel()
		if err == nil {
			w.ack(ctx, []item[T]{it}, []guard.Outcome{outcome})
			return
		}
		if ctx.Err() != nil {
			// Drain timeout: the tx was rolled back; the broker redelivers.
			w.requeue(d, RequeueShutdown)
			return
		}
		verdict, reason := classify(err, timedOut)
		switch verdict {
		case deadLetterNow:
			w.deadLetter(ctx, d, reason, err)
			return
		case holdInPlace:
			if time.Since(heldSince) >= cfg.StoreHold {
				cfg.Logger.Warn("store unavailable for store_hold, handing the delivery back", "event_id", ev.ID, "err", err, "store_hold", cfg.StoreHold)
				w.requeue(d, reason)
				return
			}
			// Not the event's fault: hold the delivery and retry in place
			// without spending its budget. Nothing is acked meanwhile.
			cfg.OnCount(CounterStoreRetry)
			delay := cfg.RetryBackoff.Delay(wait)
			cfg.Logger.Warn("store unavailable, retrying in place", "event_id", ev.ID, "attempt", attempt, "err", err, "delay", delay)
			if !sleep(w.stop, delay) {
				w.requeue(d, RequeueShutdown)
				return
			}
			continue
		}
		if attempt >= cfg.DeliveryLimit {
			cfg.Logger.Error("attempts exhausted, dead-lettering", "event_id", ev.ID, "reason", reason, "attempt", attempt, "err", err, "delivery_limit", cfg.DeliveryLimit)
			w.deadLetter(ctx, d, reason, err)
			return
		}
		delay := cfg.RetryBackoff.Delay(attempt)
		cfg.Logger.Warn("attempt failed, will retry", "event_id", ev.ID, "reason", reason, "attempt", attempt, "err", err, "delay", delay)
		sleep(w.stop, delay)
		w.requeue(d, reason)
		return
	}
}

// messageOf is what a Handler's Decode sees of d.
func messageOf(d amqp.Delivery) Message {
	return Message{ID: d.MessageId, Timestamp: d.Timestamp, ContentType: d.ContentType, Headers: d.Headers, Body: d.Body}
}

// ack acks items after their outcomes are durable, in as few frames as is
// safe.
func (w *worker[T]) ack(ctx context.Context, items []item[T], outcomes []guard.Outcome) {
	tags := make([]uint64, len(items))
	for i, it := range items {
		w.c.cfg.Hook(ctx, StepBeforeAck)
		tags[i] = it.d.DeliveryTag
	}
	if err := w.acker.ack(tags); err != nil {
		// The channel is gone; the broker redelivers and the guard
		// reports a duplicate.
		w.c.cfg.Logger.Warn("ack failed", "err", err, "deliveries", len(tags))
	}
	for i, o := range outcomes {
		w.c.cfg.OnOutcome(o, "")
		if w.c.cfg.OnSettled != nil {
			w.c.cfg.OnSettled(messageOf(items[i].d), o, "")
		}
	}
}

func (w *worker[T]) requeue(d amqp.Delivery, reason string) {
	if err := w.acker.nack(d.DeliveryTag); err != nil {
		w.c.cfg.Logger.Warn("nack failed", "err", err)
	}
	w.c.cfg.OnOutcome(guard.OutcomeRetry, reason)
	if w.c.cfg.OnSettled != nil {
		w.c.cfg.OnSettled(messageOf(d), guard.OutcomeRetry, reason)
	}
}

// deadLetter publishes d to the dead-letter exchange with its reason,
// mandatory, waits for the broker's confirm, and only then acks d. A dead
// letter that was not confirmed, or that the broker returned because no
// queue took it (the DLQ was deleted), is requeued instead: a dead letter is
// never acked away unless it is in the dead-letter queue.
func (w *worker[T]) deadLetter(ctx context.Context, d amqp.Delivery, reason string, cause error) {
	cfg := &w.c.cfg
	msg := truncate(cause.Error(), maxErrorHeader)
	headers := amqp.Table{}
	for k, v := range d.Headers {
		headers[k] = v
	}
	// The broker's count of this delivery is not the replay's: a message
	// replayed from the DLQ starts with a fresh budget. Ours is kept for
	// diagnosis in HeaderDeliveryCount.
	delete(headers, "x-delivery-count")
	headers[HeaderReason] = reason
	headers[HeaderError] = msg
	headers[HeaderQueue] = cfg.Queue
	headers[HeaderDeliveryCount] = int64(deliveryCount(d) + 1)

	routed, err := w.dl.publish(ctx, cfg.ConfirmTimeout, w.c.topology, amqp.Publishing{
		Headers:      headers,
		ContentType:  d.ContentType,
		DeliveryMode: amqp.Persistent,
		MessageId:    d.MessageId,
		Timestamp:    d.Timestamp, // the event's time travels with it
		Body:         d.Body,
	})
	switch {
	case err != nil:
		cfg.Logger.Error("dead-letter publish failed, requeueing", "reason", reason, "err", err)
		w.requeue(d, RequeueUnconfirmed)
		return
	case !routed:
		cfg.Logger.Error("dead letter returned unroutable (dead-letter queue missing?): re-declaring it and requeueing",
			"reason", reason, "dead_letter_queue", w.c.topology.DeadLetterQueue)
		if err := w.dl.redeclare(w.c.topology); err != nil {
			cfg.Logger.Error("re-declare dead-letter queue", "err", err)
		}
		w.requeue(d, RequeueUnroutable)
		return
	}
	cfg.Logger.Warn("dead-lettered", "reason", reason, "err", msg, "message_id", d.MessageId)
	cfg.Hook(ctx, StepBeforeAck)
	if err := w.acker.ack([]uint64{d.DeliveryTag}); err != nil {
		cfg.Logger.Warn("ack failed", "err", err, "outcome", guard.OutcomeDeadLettered.String())
	}
	cfg.OnOutcome(guard.OutcomeDeadLettered, reason)
	if cfg.OnSettled != nil {
		cfg.OnSettled(messageOf(d), guard.OutcomeDeadLettered, reason)
	}
}

// publish sends p to t's dead-letter exchange, mandatory, and reports
// whether the broker routed it to a queue and confirmed it.
func (dl *deadLetterer) publish(ctx context.Context, timeout time.Duration, t Topology, p amqp.Publishing) (routed bool, err error) {
	dl.mu.Lock()
	defer dl.mu.Unlock()
	dl.seq++
	id := strconv.FormatUint(dl.seq, 10)
	p.Headers[HeaderDeadLetterID] = id
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	dc, err := dl.pub.PublishWithDeferredConfirmWithContext(ctx, t.DeadLetterExchange, t.DeadLetterQueue, true, false, p)
	if err != nil {
		return false, err
	}
	ok, err := dc.WaitContext(ctx)
	if err != nil {
		return false, err
	}
	if !ok {
		return false, errors.New("broker nacked the dead letter")
	}
	// The broker sends basic.return before the ack, and the library hands
	// it to our buffered channel before it reads the ack: if this publish
	// was returned, the return is already waiting.
	for {
		select {
		case r := <-dl.returns:
			if r.Headers[HeaderDeadLetterID] == id {
				return false, nil
			}
		default:
			return true, nil
		}
	}
}

func (dl *deadLetterer) redeclare(t Topology) error {
	dl.mu.Lock()
	defer dl.mu.Unlock()
	return t.Declare(dl.pub)
}

// deliveryCount is how many times the broker delivered d before. Only the
// broker's own redelivery information counts: a first delivery
// (Redelivered false) has spent nothing, whatever x-delivery-count header a
// publisher set; a redelivery reads the count the quorum queue wrote.
func deliveryCount(d amqp.Delivery) int {
	if !d.Redelivered {
		return 0
	}
	switch n := d.Headers["x-delivery-count"].(type) {
	case int64:
		return max(int(n), 1)
	case int32:
		return max(int(n), 1)
	case int:
		return max(n, 1)
	case int16:
		return max(int(n), 1)
	case int8:
		return max(int(n), 1)
	}
	return 1
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
