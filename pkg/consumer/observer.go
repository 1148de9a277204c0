package consumer

import (
	"context"
	"log/slog"
	"time"

	"github.com/idemhq/idem/pkg/guard"
)

// Observer sees what the consumer does: for metrics, logs and tracing. It is
// called on the deliveries' path, so it must be fast and safe for
// concurrent use. Package metrics has a Prometheus implementation, which
// also implements guard.Observer.
type Observer interface {
	// Settled is called once per delivery, right after it was acked,
	// requeued or dead-lettered.
	Settled(ctx context.Context, s Settlement)
	// Count is called when a Counter* event happens, with how many times.
	Count(counter string, n int)
	// Gathered is called with the number of deliveries of each batch the
	// consumer gathers, before they are decoded.
	Gathered(deliveries int)
}

// Settlement is how one delivery ended.
type Settlement struct {
	// Message is the delivery. Read it; do not keep Body or Headers.
	Message Message
	// EventID is the event's ID; empty when the delivery could not be
	// decoded.
	EventID string
	// Scope is the guard's scope.
	Scope string
	// Outcome is what happened: a Guard outcome, or OutcomeRetry (handed
	// back to the queue) or OutcomeDeadLettered. A payload conflict is
	// dead-lettered, and reported as OutcomePayloadConflict.
	Outcome guard.Outcome
	// Reason says why, for OutcomeRetry, OutcomeDeadLettered and
	// OutcomePayloadConflict (one of the Reason* and Requeue* constants,
	// or a handler's own reason); empty otherwise.
	Reason string
	// Err is what failed, for OutcomeRetry and OutcomeDeadLettered.
	Err error
	// Attempt is this delivery's attempt number, from 1.
	Attempt int
	// EventTime is the producer's time for the event (the payload's, else
	// the AMQP timestamp); zero if it has none.
	EventTime time.Time
	// Received is when this consumer took the delivery from the broker.
	Received time.Time
}

// Counters passed to Observer.Count.
const (
	// CounterStoreRetry counts attempts retried in place because Postgres
	// was unreachable (the delivery is held, its budget untouched).
	CounterStoreRetry = "store_retries_in_place"
	// CounterUntimedAccepted counts events without a time let through to
	// the store under UntimedAuto (which still refuses them after a prune).
	CounterUntimedAccepted = "untimed_accepted"
	// CounterBatchSplit counts batches split in two because their
	// transaction failed for a reason that may be one event's.
	CounterBatchSplit = "batch_splits"
	// CounterDeferred counts batches that set events aside for a moment
	// because another consumer held their lease (see Config.BatchSize).
	CounterDeferred = "deferrals"
	// CounterPublishBlocked counts the times the broker blocked the
	// publishing connection (a memory or disk alarm); Stats.Blocked says
	// whether it is blocked now.
	CounterPublishBlocked = "publish_blocked"
	// CounterReconnect counts reconnections to RabbitMQ: a session that
	// ended, or a dial that failed, and is tried again.
	CounterReconnect = "reconnects"
	// CounterDeadLetterReturned counts dead letters the broker returned
	// unroutable (the dead-letter queue was missing); each was requeued.
	CounterDeadLetterReturned = "dead_letters_returned"
)

// Counters lists every Counter*, for metrics that want a zero for each.
func Counters() []string {
	return []string{CounterStoreRetry, CounterUntimedAccepted, CounterBatchSplit, CounterDeferred,
		CounterReconnect, CounterDeadLetterReturned, CounterPublishBlocked}
}

// Stats is a consumer's state at one moment.
type Stats struct {
	// Consuming is whether a session with the broker is consuming now.
	Consuming bool
	// InFlight counts deliveries taken from the broker whose outcome is
	// not reached yet.
	InFlight int
	// Unacked counts deliveries the broker counts against Prefetch: in
	// flight, or settled and waiting for their ack frame.
	Unacked int
	// Prefetch is Config.Prefetch.
	Prefetch int
	// Stranded counts the messages in queues of the stream that nobody
	// consumes (Topology.Strays), as last checked; StrandedIn names them.
	Stranded   int
	StrandedIn []string
	// Blocked says why the broker blocks this consumer's publishing
	// connection (a memory or disk alarm: "low on memory"); empty when it
	// does not. Dead letters wait meanwhile, unacked; acks go on.
	Blocked string
}

type nopObserver struct{}

func (nopObserver) Settled(context.Context, Settlement) {}
func (nopObserver) Count(string, int)                   {}
func (nopObserver) Gathered(int)                        {}

// settled reports how a delivery ended, to the Observer and the log. Every
// line about one event carries event_id, scope (from the logger), outcome
// and reason.
func (w *worker[T]) settled(ctx context.Context, it item[T], o guard.Outcome, reason string, err error) {
	c := w.c
	s := Settlement{
		Message:   MessageOf(it.d),
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
		if reason == RequeueShutdown {
			// Expected on every drain that outlasts in-flight work.
			level, err = slog.LevelInfo, nil
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
