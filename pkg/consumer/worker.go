package consumer

import (
	"cmp"
	"context"
	"encoding/hex"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/step"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/guard"
)

// maxErrorHeader bounds the error text copied into a dead letter.
const maxErrorHeader = 1024

// shared is what a Consumer's workers share of it: its settings, guard,
// handler and topology, whether the broker blocks its publishing, and its
// kill switch.
type shared[T any] struct {
	cfg      Config
	guard    *guard.Guard
	handler  Handler[T]
	topology broker.Topology
	blocked  blockState
	kill     *killSwitch
	// progress is when a delivery last reached an outcome other than a
	// hand-back (Unix nanoseconds; 0: never), for Stats.LastSettled.
	progress atomic.Int64
}

// worker handles deliveries of one session.
type worker[T any] struct {
	c     *shared[T]
	pubs  *publishing // the publishing connection, for dead letters
	acker *acker
	stop  context.Context // ends when shutdown begins or the session fails
	// queueOf names the queue of each consumer tag, for dead letters.
	queueOf map[string]string
	// letters are the dead letters sendLetters publishes, in order.
	letters chan letter[T]
	// storeAway ends the session: a hold ran out with the store still
	// unreachable. Safe to call more than once.
	storeAway func()
	// trip ends the session: the kill switch is open, and every delivery
	// the workers take from now on goes back to the queue (tripped is
	// closed). resume ends it once a probe closed the switch. Safe to call
	// more than once.
	trip, resume func()
	tripped      <-chan struct{}
	// holds are the keys held after a hand-back (Config.KeyOrder).
	holds keyHolds
	// confirms hold, by shard, the batches of duplicates waiting for the
	// store to confirm their markers (confirmStage); leftovers are the
	// batches it found markers of another history in, decided on
	// goroutines of their own.
	confirms  []*confirmShard[T]
	leftovers sync.WaitGroup
	// deciding counts the batches handed to the deciders and not yet
	// decided; the screen stage holds its deferred events while any is
	// (screenStage).
	deciding atomic.Int64
}

// keyHolds keeps a key held, with Config.KeyOrder, once one of its events
// was handed back to the queue (held in place past StoreHold, say): the
// events of that key this consumer received before the hand-back must not
// be applied ahead of it, so they are handed back too, in order. The broker
// puts a handed-back message back at its place in the queue, so the key's
// events come back in their order; the hold ends at the first redelivery of
// one of the events handed back (the earliest, unless another consumer took
// it). A session's deliveries all return when it ends, and its holds end
// with it.
type keyHolds struct {
	mu   sync.Mutex
	held map[string]*keyHold // by guard.Event.ShardKey
}

// keyHold is one held key.
type keyHold struct {
	reason string          // why its first event was handed back
	ids    map[string]bool // the IDs of its events handed back since
}

// add records that the event id of key goes back to the queue for reason.
// Callers hold k.mu.
func (k *keyHolds) add(key, id, reason string) {
	if k.held == nil {
		k.held = map[string]*keyHold{}
	}
	h, ok := k.held[key]
	if !ok {
		h = &keyHold{reason: reason, ids: map[string]bool{}}
		k.held[key] = h
	}
	h.ids[id] = true
}

// letter is a dead letter on its way: the delivery, why, what to publish,
// and when it was handed over.
type letter[T any] struct {
	it     item[T]
	reason string
	cause  error
	p      amqp.Publishing
	queued time.Time
}

// prepare decodes d, received at received, and checks its time. A delivery
// that cannot be processed is dead-lettered here, and prepare reports false.
func (w *worker[T]) prepare(ctx context.Context, d amqp.Delivery, received time.Time) (item[T], bool) {
	if limit := w.c.cfg.MaxBodyBytes; len(d.Body) > limit {
		err := fmt.Errorf("body is %d bytes, more than max_body_bytes (%d)", len(d.Body), limit)
		w.deadLetter(ctx, item[T]{d: d, received: received}, wire.ReasonBodyTooLarge, err)
		return item[T]{}, false
	}
	ev, v, err := w.c.handler.Decode(messageOf(d))
	if err == nil {
		err = ev.Validate()
		if err != nil {
			err = Reject(wire.ReasonInvalidEvent, err)
		}
	}
	if err != nil {
		reason, ok := rejectReason(err)
		if !ok {
			reason = wire.ReasonDecode
		}
		// The ID, if Decode got that far, names the event in logs and in
		// the dead letter's headers.
		w.deadLetter(ctx, item[T]{d: d, ev: guard.Event{ID: ev.ID}, received: received}, reason, err)
		return item[T]{}, false
	}
	if ev.Time.IsZero() {
		ev.Time = d.Timestamp
	}
	it := item[T]{d: d, ev: ev, v: v, received: received}
	if reason, err := w.c.checkTime(ev.Time, time.Now()); err != nil {
		w.deadLetter(ctx, it, reason, err)
		return item[T]{}, false
	}
	return it, true
}

// messageOf is what a Handler's Decode sees of d. Tools that read
// deliveries themselves (the dead-letter queue, say) decode them with it.
func messageOf(d amqp.Delivery) Message {
	return Message{ID: d.MessageId, Timestamp: d.Timestamp, ContentType: d.ContentType, Headers: d.Headers, Body: d.Body}
}

// ack acks items after their outcomes are durable, in as few frames as is
// safe.
func (w *worker[T]) ack(ctx context.Context, items []item[T], outcomes []guard.Outcome) {
	tags := make([]uint64, len(items))
	for i, it := range items {
		step.Reached(ctx, step.BeforeAck)
		tags[i] = it.d.DeliveryTag
	}
	if err := w.acker.ack(tags); err != nil {
		// The channel is gone; the broker redelivers and the guard
		// reports a duplicate.
		w.c.cfg.Logger.Warn("ack failed", "err", err, "deliveries", len(tags))
	}
	for i, o := range outcomes {
		w.settled(ctx, items[i], o, "", nil)
	}
}

// requeue hands it back to the queue, for reason, after err.
func (w *worker[T]) requeue(ctx context.Context, it item[T], reason string, err error) {
	if err := w.acker.nack(it.d.DeliveryTag); err != nil {
		w.c.cfg.Logger.Warn("nack failed", "event_id", it.ev.ID, "err", err)
	}
	w.settled(ctx, it, guard.OutcomeRetry, reason, err)
}

// deadLetter hands it to sendLetters, to be published to the dead-letter
// exchange with its reason and acked once the broker confirmed it. It does
// not wait: a dead letter waiting for its confirm, or for the broker to
// unblock publishing, never holds up the deliveries behind it.
func (w *worker[T]) deadLetter(ctx context.Context, it item[T], reason string, cause error) {
	cfg := &w.c.cfg
	d := it.d
	msg := truncate(cause.Error(), maxErrorHeader)
	headers := letterHeaders(d.Headers)
	headers[wire.HeaderReason] = reason
	headers[wire.HeaderError] = msg
	headers[wire.HeaderQueue] = cmp.Or(w.queueOf[d.ConsumerTag], cfg.Queue)
	headers[wire.HeaderDeliveryCount] = int64(deliveryCount(d) + 1)
	headers[wire.HeaderDeadLetteredAt] = time.Now().UTC()
	if guard.ValidateID(it.ev.ID) == nil {
		headers[wire.HeaderEventID] = it.ev.ID
	}
	if len(it.ev.Hash) > 0 {
		headers[wire.HeaderPayloadHash] = hex.EncodeToString(it.ev.Hash)
	}
	if it.ev.ShardKey != "" {
		headers[wire.HeaderShardKey] = it.ev.ShardKey
	}
	body := d.Body
	if reason == wire.ReasonBodyTooLarge {
		// Enough to identify it; the whole of it would cost the DLQ what
		// the limit spared the consumer.
		headers[wire.HeaderBodyBytes] = int64(len(d.Body))
		body = d.Body[:min(len(d.Body), cfg.MaxBodyBytes, maxLetterBody)]
	}
	w.letters <- letter[T]{it: it, reason: reason, cause: cause, queued: time.Now(), p: amqp.Publishing{
		Headers:      headers,
		ContentType:  d.ContentType,
		DeliveryMode: amqp.Persistent,
		MessageId:    d.MessageId,
		Timestamp:    d.Timestamp, // the event's time travels with it
		Body:         body,
	}}
}

// letterHeaders are the headers of a delivery a dead letter of it carries:
// the producer's, but none in idem's namespace (x-idem-*, any case), which
// the tools trust to name and explain a dead letter; a replay's count and
// ID excepted, of their types (the ID no longer than a short string, so that
// idem's own headers always fit a frame). Nor the broker's x-delivery-count: a message
// replayed from the DLQ starts with a fresh budget (ours is kept for
// diagnosis in wire.HeaderDeliveryCount). Nor x-death and its summaries:
// the tools take a dead letter with x-death for one the broker wrote, whose
// x-idem-* headers are the producer's (see internal/dlq's Message).
func letterHeaders(in amqp.Table) amqp.Table {
	out := amqp.Table{}
	for k, v := range in {
		if wire.Ours(k) || k == "x-delivery-count" || k == "x-death" ||
			strings.HasPrefix(k, "x-first-death-") || strings.HasPrefix(k, "x-last-death-") {
			continue
		}
		out[k] = v
	}
	switch v := in[wire.HeaderReplays].(type) {
	case int8, int16, int32, int64, int:
		out[wire.HeaderReplays] = v
	}
	if v, ok := in[wire.HeaderReplayID].(string); ok && len(v) <= broker.MaxShortString {
		out[wire.HeaderReplayID] = v
	}
	return out
}

// sendLetters publishes the dead letters deadLetter hands it, one at a time,
// until letters is closed.
func (w *worker[T]) sendLetters(ctx context.Context) {
	for l := range w.letters {
		w.sendLetter(ctx, l)
	}
}

// sendLetter publishes l mandatory, waits for the broker's confirm, and only
// then acks its delivery. A dead letter that was not confirmed, or that the
// broker returned because no queue took it (the DLQ was deleted), is
// requeued instead: a dead letter is never acked away unless it is in the
// dead-letter queue. While the session has no publishing connection (lost,
// refused, or not answering its handshake) or the broker blocks it (a
// resource alarm), the letter waits, its delivery unacked, until one
// publishes again or the session ends (awaitPublisher).
func (w *worker[T]) sendLetter(ctx context.Context, l letter[T]) {
	cfg := &w.c.cfg
	it, reason, cause := l.it, l.reason, l.cause
	pub, why, err := w.awaitPublisher(l)
	if pub == nil {
		w.requeue(ctx, it, why, err)
		return
	}
	routed, err := publishLetter(ctx, pub, cfg.ConfirmTimeout, w.c.topology, l.p)
	switch {
	case err != nil:
		cfg.Logger.Error("dead-letter publish failed, requeueing", "event_id", it.ev.ID, "reason", reason, "err", err)
		w.requeue(ctx, it, wire.RequeueUnconfirmed, err)
		return
	case !routed:
		cfg.Logger.Error("dead letter returned unroutable (dead-letter queue missing?): re-declaring it and requeueing",
			"event_id", it.ev.ID, "reason", reason, "dead_letter_queue", w.c.topology.DeadLetterQueue)
		cfg.Observer.Count(wire.CounterDeadLetterReturned, 1)
		if err := pub.Declare(w.c.topology.DeclareDeadLetter); err != nil {
			cfg.Logger.Error("re-declare dead-letter queue", "err", err)
		}
		w.requeue(ctx, it, wire.RequeueUnroutable, cause)
		return
	}
	step.Reached(ctx, step.BeforeAck)
	if err := w.acker.ack([]uint64{it.d.DeliveryTag}); err != nil {
		cfg.Logger.Warn("ack failed", "event_id", it.ev.ID, "err", err, "outcome", guard.OutcomeDeadLettered.String())
	}
	outcome := guard.OutcomeDeadLettered
	if reason == wire.ReasonPayloadConflict {
		outcome = guard.OutcomePayloadConflict
	}
	w.settled(ctx, it, outcome, reason, cause)
}

// awaitPublisher returns the session's publisher once it is open and the
// broker does not block it. The wait is bounded as a store outage's hold
// is: after StoreHold from when the letter was handed over, well inside the
// broker's consumer_timeout, it returns nil with the reason and error to
// requeue the delivery with, and the delivery comes back to wait again;
// so it does at once when the session ends.
func (w *worker[T]) awaitPublisher(l letter[T]) (pub *broker.Publisher, reason string, err error) {
	cfg := &w.c.cfg
	giveUp := time.NewTimer(time.Until(l.queued.Add(cfg.StoreHold)))
	defer giveUp.Stop()
	said := ""
	for {
		pub, changes, down := w.pubs.current()
		if pub != nil && pub.Err() != nil {
			// Ended, and not yet replaced: a letter sent on it fails at
			// once and would come straight back. Wait for the next.
			pub, down = nil, pub.Err()
		}
		var cleared <-chan struct{}
		switch {
		case pub == nil:
			reason, err = wire.RequeueUnconfirmed, fmt.Errorf("no publishing connection for store_hold (%s): %w", cfg.StoreHold, down)
			if said != "down" {
				said = "down"
				cfg.Logger.Warn("dead letter waits: no publishing connection", "event_id", l.it.ev.ID, "reason", l.reason, "err", down)
			}
		default:
			var why string
			if why, cleared = pub.Blocked(); cleared == nil {
				return pub, "", nil
			}
			reason, err = wire.RequeuePublishBlocked, fmt.Errorf("the broker blocked publishing for store_hold (%s): %s", cfg.StoreHold, why)
			if said != "blocked" {
				said = "blocked"
				cfg.Logger.Warn("dead letter waits: the broker blocks publishing", "event_id", l.it.ev.ID, "reason", l.reason, "blocked", why)
			}
		}
		select {
		case <-changes:
		case <-cleared:
		case <-giveUp.C:
			return nil, reason, err
		case <-w.stop.Done():
			return nil, wire.RequeueShutdown, l.cause
		}
	}
}

// publishLetter sends p to t's dead-letter exchange on pub, mandatory, and
// reports whether the broker routed it to a queue and confirmed it.
func publishLetter(ctx context.Context, pub *broker.Publisher, timeout time.Duration, t broker.Topology, p amqp.Publishing) (routed bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	// A letter whose header frame would exceed the broker's frame_max (the
	// producer's headers filled most of a frame, and idem adds its own)
	// leaves out the producer's largest headers, and names them.
	res := pub.Publish(ctx, broker.Message{Exchange: t.DeadLetterExchange, Key: t.DeadLetterQueue, Publishing: p, Keep: wire.Ours})[0]
	switch res.Outcome {
	case broker.Confirmed:
		return true, nil
	case broker.Returned:
		return false, nil
	}
	return false, res.Err
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

// settled reports how a delivery ended, to the Observer and the log. Every
// line about one event carries event_id, scope (from the logger), outcome
// and reason.
func (w *worker[T]) settled(ctx context.Context, it item[T], o guard.Outcome, reason string, err error) {
	c := w.c
	if o != guard.OutcomeRetry {
		c.progress.Store(time.Now().UnixNano())
		if c.kill.settle(it.ev.ID, o) {
			w.resume()
		}
	}
	s := Settlement{
		Message:   messageOf(it.d),
		EventID:   it.ev.ID,
		Scope:     c.guard.Scope(),
		Outcome:   o,
		Reason:    reason,
		Err:       err,
		Attempt:   deliveryCount(it.d) + 1,
		EventTime: it.ev.Time,
		Received:  it.received,
	}
	c.cfg.Observer.Settled(ctx, s)
	level := slog.LevelDebug
	msg := "settled"
	switch o {
	case guard.OutcomeRetry:
		level, msg = slog.LevelWarn, "requeued"
		switch reason {
		case wire.RequeueShutdown:
			// Expected on every drain that outlasts in-flight work.
			level, err = slog.LevelInfo, nil
		case wire.RequeueKillSwitch:
			// The trip, and each failed probe, said it once for all the
			// deliveries it hands back.
			level = slog.LevelDebug
		}
	case guard.OutcomeDeadLettered:
		level, msg = slog.LevelWarn, "dead-lettered"
	case guard.OutcomePayloadConflict:
		level, msg = slog.LevelError, "payload conflict: the event ID was processed before with another payload; dead-lettered"
	}
	log := c.cfg.Logger
	if !log.Enabled(ctx, level) {
		return
	}
	attrs := []slog.Attr{
		slog.String("event_id", it.ev.ID), slog.String("outcome", o.String()), slog.String("reason", reason),
		slog.Int("attempt", s.Attempt), slog.String("message_id", it.d.MessageId),
	}
	if err != nil {
		attrs = append(attrs, slog.String("err", truncate(err.Error(), maxErrorHeader)))
	}
	log.LogAttrs(ctx, level, msg, attrs...)
}
