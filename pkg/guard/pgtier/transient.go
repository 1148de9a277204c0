package pgtier

import (
	"errors"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// IsTransient reports whether err says PostgreSQL was unreachable or
// restarting, or that the transaction lost a race it can win on retry
// (serialization failure, deadlock). Such errors are no fault of the event:
// the caller should retry the same delivery after a backoff rather than count
// it toward dead-lettering.
func IsTransient(err error) bool {
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch {
		case strings.HasPrefix(pgErr.Code, "08"): // connection_exception class
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
	var connectErr *pgconn.ConnectError
	var netErr net.Error
	return errors.As(err, &connectErr) ||
		errors.As(err, &netErr) ||
		pgconn.SafeToRetry(err) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, net.ErrClosed) ||
		strings.Contains(err.Error(), "conn closed")
}
