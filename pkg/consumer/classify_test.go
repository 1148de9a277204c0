package consumer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/guard"
)

func TestClassifyHoldsOnlyAnUnreachableStore(t *testing.T) {
	pg := func(code string) error { return &pgconn.PgError{Code: code, Message: "m"} }
	handler := func(err error) error { return fmt.Errorf("apply: %w", err) }
	store := func(op guard.StoreOp, err error) error { return &guard.StoreError{Op: op, Err: err} }
	cases := []struct {
		name     string
		err      error
		timedOut bool
		verdict  verdict
		reason   string
	}{
		// Unreachable or restarting: held in place.
		{"connection refused at begin", store(guard.StoreBegin, &net.OpError{Op: "dial", Err: errors.New("connection refused")}), false, holdInPlace, wire.RequeueStoreUnavailable},
		{"connection lost at commit", store(guard.StoreCommit, io.ErrUnexpectedEOF), false, holdInPlace, wire.RequeueStoreUnavailable},
		{"admin shutdown", store(guard.StoreClaim, pg("57P01")), false, holdInPlace, wire.RequeueStoreUnavailable},
		{"cannot connect now", store(guard.StoreBegin, pg("57P03")), false, holdInPlace, wire.RequeueStoreUnavailable},
		{"a claimed row locked by another session (lock_timeout)", store(guard.StoreClaim, pg("55P03")), false, holdInPlace, wire.RequeueLockWait},
		{"a handler statement that waited lock_timeout", handler(pg("55P03")), false, spendAttempt, wire.ReasonHandlerTimeout},
		{"BEGIN queued behind a prune's request for the horizon lock", store(guard.StoreBegin, pg("55P03")), false, holdInPlace, wire.RequeueLockWait},
		{"a write on a standby: the switch's to decide (a failover passes, a deploy pointed at a replica trips it)", store(guard.StoreClaim, pg("25006")), false, spendAttempt, wire.ReasonStoreFailed},
		{"commit outlasting the deadline (a silent link)", store(guard.StoreCommit, context.DeadlineExceeded), true, holdInPlace, wire.RequeueStoreUnavailable},
		{"too many connections", store(guard.StoreBegin, pg("53300")), false, holdInPlace, wire.RequeueStoreUnavailable},
		{"connection exception class", store(guard.StoreClaim, pg("08006")), false, holdInPlace, wire.RequeueStoreUnavailable},
		{"serialization failure in handler", handler(pg("40001")), false, holdInPlace, wire.RequeueStoreUnavailable},
		{"deadlock in handler", handler(pg("40P01")), false, holdInPlace, wire.RequeueStoreUnavailable},
		{"no connection before the deadline", store(guard.StoreBegin, context.DeadlineExceeded), true, holdInPlace, wire.RequeueStoreUnavailable},
		// The event's own doing: spends an attempt.
		{"handler query outlasts the timeout", handler(pg("57014")), true, spendAttempt, wire.ReasonHandlerTimeout},
		{"slow downstream honouring ctx", handler(context.DeadlineExceeded), true, spendAttempt, wire.ReasonHandlerTimeout},
		{"deadline error that did not fire", handler(context.DeadlineExceeded), false, spendAttempt, wire.ReasonHandlerFailed},
		{"claim timed out waiting on a row lock", store(guard.StoreClaim, context.DeadlineExceeded), true, holdInPlace, wire.RequeueLockWait},
		{"commit rolled back", store(guard.StoreCommit, pgx.ErrTxCommitRollback), false, spendAttempt, wire.ReasonCommitFailed},
		{"handler error", handler(errors.New("downstream said no")), false, spendAttempt, wire.ReasonHandlerFailed},
		{"raised exception", handler(pg("P0001")), false, spendAttempt, wire.ReasonHandlerFailed},
		{"missing table at claim", store(guard.StoreClaim, pg("42P01")), false, spendAttempt, wire.ReasonStoreFailed},
		// The same input fails every time: dead-lettered at once.
		{"deferred unique violation at commit", store(guard.StoreCommit, pg("23505")), false, deadLetterNow, wire.ReasonIntegrityViolation},
		{"check violation in handler", handler(pg("23514")), false, deadLetterNow, wire.ReasonIntegrityViolation},
		{"bigint overflow in handler", handler(pg("22003")), false, deadLetterNow, wire.ReasonNumericOverflow},
		{"NUL in text", handler(pg("22021")), false, deadLetterNow, wire.ReasonDataException},
		{"handler reject", handler(Reject("no_such_account", errors.New("x"))), false, deadLetterNow, "no_such_account"},
		{"payload conflict", guard.ErrPayloadConflict, false, deadLetterNow, wire.ReasonPayloadConflict},
		{"row pruned under the claim", store(guard.StoreClaim, fmt.Errorf("claim e: %w", guard.ErrBeyondRetention)), false, deadLetterNow, wire.ReasonBeyondRetention},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			v, reason := classify(c.err, c.timedOut)
			require.Equal(t, c.verdict, v)
			require.Equal(t, c.reason, reason)
		})
	}
}
