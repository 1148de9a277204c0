package consumer

import (
	"context"
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

// Stats is a consumer's state at one moment.
type Stats struct {
	// Consuming is whether a session with the broker is consuming now.
	Consuming bool
	// LastSettled is when a delivery last reached its outcome (applied, a
	// duplicate, dead-lettered; a hand-back to the queue does not count):
	// whether work goes on. Zero if none did yet.
	LastSettled time.Time
	// InFlight counts deliveries received from the broker whose outcome
	// is not reached yet, wherever they wait (for room in a batch, in one,
	// for a confirm, a dead letter or a hold).
	InFlight int
	// Unacked counts deliveries the broker counts against Prefetch: in
	// flight, or settled and waiting for their ack frame.
	Unacked int
	// Prefetch is Config.Prefetch.
	Prefetch int
	// Stranded counts the messages in queues of the stream that nobody
	// consumes (see Config.FormerPartitions: a former partition count, or
	// partitions beyond the count), as last checked; StrandedIn names them.
	Stranded   int
	StrandedIn []string
	// Blocked says why the broker blocks this consumer's publishing
	// connection (a memory or disk alarm: "low on memory"); empty when it
	// does not. Dead letters wait meanwhile, unacked; acks go on.
	Blocked string
	// Publishing says why the session has no publishing connection now
	// (lost, refused, or its handshake unanswered): dead letters wait
	// meanwhile, unacked, up to StoreHold; other events and their acks go
	// on. Empty while it has one, or is opening its first.
	Publishing string
	// Refused says why the last session ended, when RabbitMQ refused the
	// connection or dropped it during the handshake (bad credentials, a
	// vhost, a connection limit; or a broker restarting, a network fault):
	// the consumer retries meanwhile. Empty once a session consumes, or
	// ends otherwise.
	Refused string
	// Tripped says why the kill switch stopped the consumer (see
	// KillSwitch): how many distinct events failed, with what, and when it
	// probes next; TrippedOn is the error class (a SQLSTATE such as 42P01,
	// or a reason such as handler_failed). Empty while the switch is closed.
	Tripped   string
	TrippedOn string
}

type nopObserver struct{}

func (nopObserver) Settled(context.Context, Settlement) {}
func (nopObserver) Count(string, int)                   {}
func (nopObserver) Gathered(int)                        {}
