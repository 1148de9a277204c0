package consumer

import (
	"errors"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/internal/pgerr"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/guard"
)

// verdict is what the consumer does after a failed attempt.
type verdict int

const (
	// deadLetterNow: the same input fails every time; spend no more attempts.
	deadLetterNow verdict = iota + 1
	// holdInPlace: the store is unreachable or restarting, which is not the
	// event's fault; retry the same delivery without spending its budget,
	// for at most Config.StoreHold.
	holdInPlace
	// spendAttempt: count the attempt against Config.DeliveryLimit, then
	// requeue or dead-letter.
	spendAttempt
)

// inHandler reports an error of the handler's own statements, not of a
// guard statement (BEGIN, the claim, the history read, COMMIT).
func inHandler(err error) bool {
	var se *guard.StoreError
	return !errors.As(err, &se)
}

// classify decides what a failed attempt leads to, and the reason that names
// it in dead letters and metrics. timedOut says the attempt's own deadline
// (Config.HandlerTimeout) fired, as opposed to shutdown.
func classify(err error, timedOut bool) (verdict, string) {
	if reason, ok := rejectReason(err); ok {
		return deadLetterNow, reason
	}
	switch {
	case errors.Is(err, guard.ErrPayloadConflict):
		return deadLetterNow, wire.ReasonPayloadConflict
	case errors.Is(err, guard.ErrInvalidID), errors.Is(err, guard.ErrInvalidEvent):
		return deadLetterNow, wire.ReasonInvalidEvent
	case errors.Is(err, guard.ErrBeyondRetention):
		return deadLetterNow, wire.ReasonBeyondRetention
	case errors.Is(err, guard.ErrFutureEvent):
		return deadLetterNow, wire.ReasonFutureTimestamp
	case errors.Is(err, guard.ErrUntimedEvent):
		return deadLetterNow, wire.ReasonMissingTime
	}
	if code := pgerr.SQLState(err); code != "" {
		switch {
		case code == pgerr.LockNotAvailable && !inHandler(err):
			// lock_timeout on a guard statement: on the claim, another
			// delivery of this event holds its dedup row; at BEGIN, a
			// prune's request for the horizon lock is queued. Not the
			// event's fault: a healthy holder finishes within its
			// transaction, an orphaned one is ended by the server
			// (idle_in_transaction_session_timeout); hold, spend nothing.
			return holdInPlace, wire.RequeueLockWait
		case code == pgerr.LockNotAvailable:
			// A handler's statement waited on a business row: as a
			// handler that runs out of time, the batch splits and the
			// attempt counts, so that one locked row holds up no other
			// event. It never counts for the kill switch (waited).
			return spendAttempt, wire.ReasonHandlerTimeout
		case code == "22003":
			return deadLetterNow, wire.ReasonNumericOverflow
		case strings.HasPrefix(code, "22"):
			return deadLetterNow, wire.ReasonDataException
		case strings.HasPrefix(code, "23"):
			return deadLetterNow, wire.ReasonIntegrityViolation
		}
	}
	var se *guard.StoreError
	isStore := errors.As(err, &se)
	switch {
	case timedOut && isStore && se.Op == guard.StoreClaim:
		// The claim ran out of time: it waited on a dedup row another
		// session holds (with no lock_timeout set), or on a store that
		// stopped answering. Either way nothing of the event ran.
		return holdInPlace, wire.RequeueLockWait
	case timedOut && isStore:
		// A guard statement (BEGIN, the history read, COMMIT) ran out
		// of time: the pool or the server is slow or unreachable, not
		// the event. A COMMIT whose answer was lost is safe to retry:
		// the claim finds the row if it landed.
		return holdInPlace, wire.RequeueStoreUnavailable
	case timedOut:
		return spendAttempt, wire.ReasonHandlerTimeout
	case pgerr.IsTransient(err):
		return holdInPlace, wire.RequeueStoreUnavailable
	case isStore && se.Op == guard.StoreCommit || errors.Is(err, pgx.ErrTxCommitRollback):
		return spendAttempt, wire.ReasonCommitFailed
	case isStore:
		return spendAttempt, wire.ReasonStoreFailed
	}
	return spendAttempt, wire.ReasonHandlerFailed
}
