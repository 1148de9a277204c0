package consumer

import (
	"context"
	"log/slog"
	"time"

	"github.com/idemhq/idem/internal/wire"
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
		if reason == wire.RequeueShutdown {
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
