// Package pgerr classifies PostgreSQL errors for the consumer and the
// start-up: which say the server is away (retry the same delivery), and
// which SQLSTATE an error carries; and waits out a server that is away.
package pgerr

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// IsTransient reports whether err says PostgreSQL was unreachable or
// restarting, or that the transaction lost a race it can win on retry
// (serialization failure, deadlock). Such errors are no fault of the event:
// the caller may retry the same delivery after a backoff rather than count it
// toward dead-lettering.
//
// A context deadline or cancellation is not transient, even though
// context.DeadlineExceeded satisfies net.Error: it says the caller gave up,
// not that the server is away. Errors the transaction's own content caused
// (a failed statement, a constraint checked at COMMIT) are not transient
// either: retrying them gives the same answer.
func IsTransient(err error) bool {
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		if strings.HasPrefix(pgErr.Code, "08") { // connection_exception class
			return true
		}
		switch pgErr.Code {
		case "40001", "40P01", // serialization_failure, deadlock_detected
			LockNotAvailable,          // lock_timeout: a lock another session holds, for now
			"57P01", "57P02", "57P03", // admin_shutdown, crash_shutdown, cannot_connect_now
			"53300": // too_many_connections
			return true
		}
		return false
	}
	// Could not connect (refused, unreachable, pgx's own connect timeout)
	// and the server said nothing that makes it permanent (bad password,
	// no such database: those are PgErrors, handled above).
	var connectErr *pgconn.ConnectError
	if errors.As(err, &connectErr) {
		return true
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return false
	}
	var netErr net.Error
	return errors.As(err, &netErr) ||
		pgconn.SafeToRetry(err) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, net.ErrClosed) ||
		strings.Contains(err.Error(), "conn closed")
}

// UndefinedTable is the SQLSTATE of a statement on a table that does not
// exist.
const UndefinedTable = "42P01"

// InsufficientPrivilege is the SQLSTATE of a statement the role may not
// run (CREATE on a schema it lacks the privilege on, say).
const InsufficientPrivilege = "42501"

// LockNotAvailable is the SQLSTATE of a statement that waited
// lock_timeout for a lock another session holds.
const LockNotAvailable = "55P03"

// SQLState returns the SQLSTATE of the first PostgreSQL error in err's chain,
// or "" if there is none.
func SQLState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// Wait's delays between attempts: doubling from waitMin up to waitMax.
const (
	waitMin = 200 * time.Millisecond
	waitMax = 5 * time.Second
)

// Wait runs fn (what names it in logs) until it succeeds. While
// PostgreSQL is unreachable or starting it retries, logging each wait, for up
// to timeout; an error that cannot fix itself (a bad password, a missing
// database or schema, a failing migration) ends it at once.
func Wait(ctx context.Context, timeout time.Duration, what string, log *slog.Logger, fn func(context.Context) error) error {
	deadline := time.Now().Add(timeout)
	for attempt := 1; ; attempt++ {
		actx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err := fn(actx)
		timedOut := actx.Err() != nil
		cancel()
		switch {
		case err == nil:
			return nil
		case ctx.Err() != nil:
			return ctx.Err()
		case !timedOut && !IsTransient(err):
			return fmt.Errorf("%s failed, and retrying cannot fix it (check the database URL and the database): %w", what, err)
		case time.Now().After(deadline):
			return fmt.Errorf("PostgreSQL was not reachable within the start-up timeout (%s) for %s: %w", timeout, what, err)
		}
		d := min(waitMin<<min(attempt-1, 8), waitMax)
		log.Warn("waiting for PostgreSQL", "for", what, "err", err, "retry_in", d, "gives_up_in", time.Until(deadline).Round(time.Second))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(d):
		}
	}
}
