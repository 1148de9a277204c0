// Package wire holds the names idem writes where operators and their tools
// read them: the dead-letter headers, the reasons a delivery is
// dead-lettered or handed back, and the counters the consumer reports. The
// values are a contract (docs/operations.md lists them); the names are the
// runtime's own, so they are not part of the public API.
package wire

import "strings"

// Dead-letter reasons set by the runtime. Handlers add their own through Reject.
const (
	ReasonDecode          = "decode_error"
	ReasonPayloadConflict = "payload_conflict"
	// ReasonHandlerFailed: Apply kept failing for consumer.Config.DeliveryLimit attempts.
	ReasonHandlerFailed = "handler_failed"
	// ReasonHandlerTimeout: attempts kept outlasting consumer.Config.HandlerTimeout.
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
	// ReasonBeyondRetention: the event is older than consumer.Config.Retention, or
	// its dedup row was pruned while it was claimed. Its dedup history may
	// be gone, so applying it could apply it twice.
	ReasonBeyondRetention = "beyond_retention"
	// ReasonFutureTimestamp: the event's time is more than
	// consumer.Config.ClockSkew ahead of this consumer's clock.
	ReasonFutureTimestamp = "future_timestamp"
	// ReasonMissingTime: the event carries no time (neither in its payload
	// nor as an AMQP timestamp) and consumer.Config.Untimed is consumer.UntimedReject.
	ReasonMissingTime = "missing_time"
	// ReasonInvalidEvent: Decode returned an event the guard cannot take
	// (a bad ID or an empty hash); a bug in the handler's Decode.
	ReasonInvalidEvent = "invalid_event"
	// ReasonBodyTooLarge: the body is longer than
	// consumer.Config.MaxBodyBytes; refused before Decode sees it. The dead
	// letter carries its first bytes only, and HeaderBodyBytes.
	ReasonBodyTooLarge = "body_too_large"
	// ReasonDeliveryLimit is set by the broker (x-death), not by a consumer:
	// the message exceeded the queue's x-delivery-limit, for instance
	// because it crashed every consumer that took it.
	ReasonDeliveryLimit = "delivery_limit"
)

// Reasons a delivery goes back to the queue (guard.OutcomeRetry) rather than to
// the dead-letter queue.
const (
	// RequeueStoreUnavailable: Postgres stayed unreachable for
	// consumer.Config.StoreHold, so the delivery is handed back to the broker.
	RequeueStoreUnavailable = "store_unavailable"
	// RequeueLockWait: a row the delivery needed stayed locked by another
	// session (one orphaned by a half-open connection, which the server
	// ends within idle_in_transaction_session_timeout) for StoreHold.
	RequeueLockWait = "lock_wait"
	// RequeueUnroutable: the dead-letter queue was missing, so the
	// dead letter could not be routed; the consumer re-declares it and
	// the delivery comes back.
	RequeueUnroutable = "dead_letter_unroutable"
	// RequeueUnconfirmed: the broker did not confirm the dead letter.
	RequeueUnconfirmed = "dead_letter_unconfirmed"
	// RequeuePublishBlocked: the broker blocked publishing (a memory or
	// disk alarm) for consumer.Config.StoreHold while the dead letter waited.
	RequeuePublishBlocked = "publish_blocked"
	// RequeueShutdown: the consumer stopped before the delivery's outcome.
	RequeueShutdown = "shutdown"
	// RequeueNoOutcome: the guard returned no outcome for the delivery,
	// which it never should; it is handed back rather than acked.
	RequeueNoOutcome = "no_outcome"
	// RequeueKillSwitch: the consumer's kill switch is open (distinct
	// events all fail the same way: the deploy, not the event), so the
	// delivery goes back to the queue without spending its attempts.
	RequeueKillSwitch = "kill_switch"
)

// Counters passed to consumer.Observer.Count.
const (
	// CounterStoreRetry counts attempts retried in place because Postgres
	// was unreachable (the delivery is held, its budget untouched).
	CounterStoreRetry = "store_retries_in_place"
	// CounterUntimedAccepted counts events without a time let through to
	// the store under consumer.UntimedAuto (which still refuses them after a prune).
	CounterUntimedAccepted = "untimed_accepted"
	// CounterBatchSplit counts batches split in two because their
	// transaction failed for a reason that may be one event's.
	CounterBatchSplit = "batch_splits"
	// CounterDeferred counts batches that set events aside for a moment
	// because another consumer held their lease (see consumer.Config.BatchSize).
	CounterDeferred = "deferrals"
	// CounterPublishBlocked counts the times the broker blocked the
	// publishing connection (a memory or disk alarm); consumer.Stats.Blocked says
	// whether it is blocked now.
	CounterPublishBlocked = "publish_blocked"
	// CounterReconnect counts reconnections to RabbitMQ: a session that
	// ended, or a dial that failed, and is tried again.
	CounterReconnect = "reconnects"
	// CounterDeadLetterReturned counts dead letters the broker returned
	// unroutable (the dead-letter queue was missing); each was requeued.
	CounterDeadLetterReturned = "dead_letters_returned"
	// CounterBrokerRefused counts sessions RabbitMQ refused (403, 530) or
	// dropped during the handshake, each retried; consumer.Stats.Refused
	// says whether the last one was.
	CounterBrokerRefused = "broker_refusals"
	// CounterKillSwitchTrips counts the times the kill switch tripped:
	// distinct events failed the same way, and the consumer stopped taking
	// deliveries (consumer.KillSwitch); consumer.Stats.Tripped says whether it
	// is open now.
	CounterKillSwitchTrips = "kill_switch_trips"
)

// Headers set on dead-lettered messages.
const (
	HeaderReason        = "x-idem-reason"
	HeaderError         = "x-idem-error"
	HeaderQueue         = "x-idem-queue"
	HeaderDeliveryCount = "x-idem-delivery-count"
	// HeaderDeadLetteredAt is when the consumer dead-lettered the message.
	HeaderDeadLetteredAt = "x-idem-dead-lettered-at"
	// HeaderEventID is the event ID the handler's Decode read, whenever it
	// got that far: the tools find a dead letter by it, whatever the
	// handler's body looks like.
	HeaderEventID = "x-idem-event-id"
	// HeaderPayloadHash is the event's payload hash (hex), when Decode
	// returned one: for a payload conflict, what differs from the row.
	HeaderPayloadHash = "x-idem-payload-hash"
	// HeaderShardKey is the event's shard key, when it has one: the tools
	// find the shard of its dedup row by it.
	HeaderShardKey = "x-idem-shard-key"
	// HeaderBodyBytes is the length of the delivery's body when the dead
	// letter carries only part of it (ReasonBodyTooLarge).
	HeaderBodyBytes = "x-idem-body-bytes"
	// HeaderHeadersDropped names the producer's headers that a dead letter,
	// a replay or a letter a dlq tool kept left out (comma-separated, cut
	// short at 512 bytes): with them its header frame would have exceeded
	// the broker's frame_max.
	HeaderHeadersDropped = "x-idem-headers-dropped"
)

// HeaderDeadLetterID marks each dead letter so that a basic.return can be
// matched to its publish.
const HeaderDeadLetterID = "x-idem-dead-letter-id"

// Headers a replay from the dead-letter queue sets, which survive a
// dead letter: how many times the message was replayed, and the replay that
// published it (an integer and a string; of a producer's x-idem-* headers,
// only these survive, and only of those types).
const (
	HeaderReplays  = "x-idem-replays"
	HeaderReplayID = "x-idem-replay-id"
)

// HeaderPrefix starts every header idem sets. A dead letter carries none
// of a delivery's (but HeaderReplays and HeaderReplayID): a producer's
// forged x-idem-event-id would otherwise name the dead letter for the tools.
const HeaderPrefix = "x-idem-"

// Ours reports whether header name is in idem's namespace, in any case.
func Ours(name string) bool {
	return len(name) >= len(HeaderPrefix) && strings.EqualFold(name[:len(HeaderPrefix)], HeaderPrefix)
}

// Reasons lists the dead-letter reasons the runtime and the broker write. A
// handler's Decode and Apply add their own through Reject.
func Reasons() []string {
	return []string{ReasonDecode, ReasonPayloadConflict, ReasonHandlerFailed, ReasonHandlerTimeout, ReasonCommitFailed,
		ReasonStoreFailed, ReasonDataException, ReasonNumericOverflow, ReasonIntegrityViolation, ReasonBeyondRetention,
		ReasonFutureTimestamp, ReasonMissingTime, ReasonInvalidEvent, ReasonBodyTooLarge, ReasonDeliveryLimit}
}

// Counters lists every Counter*, for metrics that want a zero for each.
func Counters() []string {
	return []string{CounterStoreRetry, CounterUntimedAccepted, CounterBatchSplit, CounterDeferred,
		CounterReconnect, CounterDeadLetterReturned, CounterPublishBlocked, CounterBrokerRefused, CounterKillSwitchTrips}
}
