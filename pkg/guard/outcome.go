package guard

// Outcome is what happened to one delivery of an event. Processed,
// DuplicateRedis, DuplicatePostgres, DuplicateBatch and PayloadConflict come
// from the Guard; Retry and DeadLettered are decided by the consumer runtime.
type Outcome int

const (
	// OutcomeUnknown is the zero value: no outcome was reached (an error).
	OutcomeUnknown Outcome = iota
	// OutcomeProcessed: the handler ran and its effect committed with the dedup row.
	OutcomeProcessed
	// OutcomeDuplicateRedis: Redis held a done marker with the same payload hash.
	OutcomeDuplicateRedis
	// OutcomeDuplicatePostgres: the dedup row already existed with the same payload hash.
	OutcomeDuplicatePostgres
	// OutcomePayloadConflict: the event ID was processed before with another payload.
	OutcomePayloadConflict
	// OutcomeRetry: processing failed and the delivery goes back to the queue.
	OutcomeRetry
	// OutcomeDeadLettered: the delivery was moved to the dead-letter queue.
	OutcomeDeadLettered
	// OutcomeDuplicateBatch: another copy of the event, with the same
	// payload hash, was in the same batch and committed.
	OutcomeDuplicateBatch
	// OutcomeRefused: the store refused to claim the event, which is
	// outside the replay horizon it enforces; Result.Err says how
	// (ErrBeyondRetention, ErrFutureEvent or ErrUntimedEvent). Nothing was
	// applied. The consumer dead-letters it.
	OutcomeRefused
)

var outcomeNames = [...]string{
	OutcomeUnknown:           "unknown",
	OutcomeProcessed:         "processed",
	OutcomeDuplicateRedis:    "duplicate_redis",
	OutcomeDuplicatePostgres: "duplicate_postgres",
	OutcomePayloadConflict:   "payload_conflict",
	OutcomeRetry:             "retry",
	OutcomeDeadLettered:      "dead_lettered",
	OutcomeDuplicateBatch:    "duplicate_batch",
	OutcomeRefused:           "refused",
}

// String returns the snake_case name used in logs and metrics.
func (o Outcome) String() string {
	if o < 0 || int(o) >= len(outcomeNames) {
		return "unknown"
	}
	return outcomeNames[o]
}

// Outcomes lists every outcome, for metrics that want a zero for each.
func Outcomes() []Outcome {
	return []Outcome{OutcomeProcessed, OutcomeDuplicateRedis, OutcomeDuplicatePostgres,
		OutcomeDuplicateBatch, OutcomePayloadConflict, OutcomeRetry, OutcomeDeadLettered}
}

// IsDuplicate reports whether the event had already been processed.
func (o Outcome) IsDuplicate() bool {
	return o == OutcomeDuplicateRedis || o == OutcomeDuplicatePostgres || o == OutcomeDuplicateBatch
}
