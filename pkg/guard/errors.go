package guard

import (
	"errors"
	"fmt"
)

var (
	// ErrPayloadConflict means the event ID was already processed with a
	// different payload hash. The event is not applied; it needs a person.
	ErrPayloadConflict = errors.New("event id already processed with a different payload")
	// ErrInvalidID means an event ID is empty, too long or has bytes outside
	// the allowed charset.
	ErrInvalidID = errors.New("invalid event id")
	// ErrInvalidEvent means an Event lacks its payload hash.
	ErrInvalidEvent = errors.New("invalid event")
	// ErrBeyondRetention means the store refused to claim the event because
	// it is older than the replay horizon the store enforces (its retention,
	// or where a prune cut), or its dedup row was pruned while it was being
	// claimed. The store can no longer tell whether it was processed: it
	// must not be applied; it needs a person.
	ErrBeyondRetention = errors.New("event is older than the replay horizon: its dedup row may have been pruned")
	// ErrFutureEvent means the store refused to claim the event because its
	// time is further ahead of the database's clock than the clock skew the
	// store enforces. Accepting it would keep its replays inside the horizon
	// longer than its dedup row is kept.
	ErrFutureEvent = errors.New("event time is further ahead than the clock skew allows")
	// ErrUntimedEvent means the store refused to claim an event that carries
	// no time, because dedup rows were pruned: it could be a replay of an
	// event whose row is gone.
	ErrUntimedEvent = errors.New("event has no time and dedup rows were pruned: it cannot be told from a replay")
	// ErrMixedShards means a batch held events of more than one shard; one
	// transaction cannot span databases. Group the events by Guard.Shard.
	ErrMixedShards = errors.New("batch spans shards")
)

// StoreError is a failure of the authoritative tier itself (begin, claim or
// commit), as opposed to a failure of the handler. The event's outcome is
// unknown to the caller until the store answers again; retrying is safe.
type StoreError struct {
	Op  StoreOp
	Err error
	// Shard is the shard's index, or -1 when the guard has one store.
	Shard int
}

func (e *StoreError) Error() string {
	if e.Shard >= 0 {
		return fmt.Sprintf("store %s (shard %d): %v", e.Op, e.Shard, e.Err)
	}
	return fmt.Sprintf("store %s: %v", e.Op, e.Err)
}
func (e *StoreError) Unwrap() error { return e.Err }

// StoreOp names the store call a StoreError comes from.
type StoreOp string

// The store calls.
const (
	// StoreBegin: no transaction began, so nothing of the events ran.
	StoreBegin StoreOp = "begin"
	// StoreClaim: inserting the dedup rows failed; the transaction rolled back.
	StoreClaim StoreOp = "claim"
	// StoreCommit: COMMIT failed, and whether it took effect is unknown
	// until the store answers again.
	StoreCommit StoreOp = "commit"
	// StoreHistory: the store did not say which history it is in, so no
	// done marker was confirmed (Guard.Confirm); nothing ran.
	StoreHistory StoreOp = "history"
)
