// Package pgerr classifies PostgreSQL errors for the consumer and the
// start-up: which say the server is away (retry the same delivery), and
// which SQLSTATE an error carries.
package pgerr

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"

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

// SQLState returns the SQLSTATE of the first PostgreSQL error in err's chain,
// or "" if there is none.
func SQLState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}
