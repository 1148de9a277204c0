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

	"github.com/idemhq/idem/pkg/guard"
)

func TestClassifyHoldsOnlyAnUnreachableStore(t *testing.T) {
	pg := func(code string) error { return &pgconn.PgError{Code: code, Message: "m"} }
	handler := func(err error) error { return &guard.HandlerError{Err: fmt.Errorf("apply: %w", err)} }
	store := func(op string, err error) error { return &guard.StoreError{Op: op, Err: err} }
	cases := []struct {
		name     string
		err      error
		timedOut bool
		verdict  verdict
		reason   string
	}{
		// Unreachable or restarting: held in place.
		{"connection refused at begin", store("begin", &net.OpError{Op: "dial", Err: errors.New("connection refused")}), false, holdInPlace, RequeueStoreUnavailable},
		{"connection lost at commit", store("commit", io.ErrUnexpectedEOF), false, holdInPlace, RequeueStoreUnavailable},
		{"admin shutdown", store("claim", pg("57P01")), false, holdInPlace, RequeueStoreUnavailable},
		{"cannot connect now", store("begin", pg("57P03")), false, holdInPlace, RequeueStoreUnavailable},
		{"too many connections", store("begin", pg("53300")), false, holdInPlace, RequeueStoreUnavailable},
		{"connection exception class", store("claim", pg("08006")), false, holdInPlace, RequeueStoreUnavailable},
		{"serialization failure in handler", handler(pg("40001")), false, holdInPlace, RequeueStoreUnavailable},
		{"deadlock in handler", handler(pg("40P01")), false, holdInPlace, RequeueStoreUnavailable},
		{"no connection before the deadline", store("begin", context.DeadlineExceeded), true, holdInPlace, RequeueStoreUnavailable},
		// The event's own doing: spends an attempt.
		{"handler query outlasts the timeout", handler(pg("57014")), true, spendAttempt, ReasonHandlerTimeout},
		{"slow downstream honouring ctx", handler(context.DeadlineExceeded), true, spendAttempt, ReasonHandlerTimeout},
		{"deadline error that did not fire", handler(context.DeadlineExceeded), false, spendAttempt, ReasonHandlerFailed},
		{"claim timed out waiting on a row lock", store("claim", context.DeadlineExceeded), true, spendAttempt, ReasonHandlerTimeout},
		{"commit rolled back", store("commit", pgx.ErrTxCommitRollback), false, spendAttempt, ReasonCommitFailed},
		{"handler error", handler(errors.New("downstream said no")), false, spendAttempt, ReasonHandlerFailed},
		{"raised exception", handler(pg("P0001")), false, spendAttempt, ReasonHandlerFailed},
		{"missing table at claim", store("claim", pg("42P01")), false, spendAttempt, ReasonStoreFailed},
		// The same input fails every time: dead-lettered at once.
		{"deferred unique violation at commit", store("commit", pg("23505")), false, deadLetterNow, ReasonIntegrityViolation},
		{"check violation in handler", handler(pg("23514")), false, deadLetterNow, ReasonIntegrityViolation},
		{"bigint overflow in handler", handler(pg("22003")), false, deadLetterNow, ReasonNumericOverflow},
		{"NUL in text", handler(pg("22021")), false, deadLetterNow, ReasonDataException},
		{"handler reject", handler(Reject("no_such_account", errors.New("x"))), false, deadLetterNow, "no_such_account"},
		{"payload conflict", guard.ErrPayloadConflict, false, deadLetterNow, ReasonPayloadConflict},
		{"row pruned under the claim", store("claim", fmt.Errorf("claim e: %w", guard.ErrBeyondRetention)), false, deadLetterNow, ReasonBeyondRetention},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			v, reason := classify(c.err, c.timedOut)
			require.Equal(t, c.verdict, v)
			require.Equal(t, c.reason, reason)
		})
	}
}
