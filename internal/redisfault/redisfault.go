// Package redisfault sorts the fast tier's faults into the few kinds its
// metrics and alerts count.
package redisfault

import (
	"context"
	"errors"
	"io"
	"net"
	"syscall"

	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"
)

// ErrCallerGone marks a Redis call abandoned because the caller's context
// ended: it says nothing of Redis, so the breaker does not count it.
var ErrCallerGone = errors.New("caller context done")

// Kinds of fast-tier fault that Kind returns.
const (
	KindBreakerOpen = "breaker_open" // the breaker refused the call; Redis was not asked
	KindTimeout     = "timeout"      // the call's deadline passed
	KindConnection  = "connection"   // refused, reset or closed connection, or no free connection
	KindServer      = "server"       // Redis answered with an error (OOM, READONLY, LOADING, …)
	KindCanceled    = "canceled"     // the caller's context ended first; says nothing of Redis
	KindOther       = "other"
)

// Kinds lists every kind Kind returns, for metrics that want a
// zero for each.
func Kinds() []string {
	return []string{KindBreakerOpen, KindTimeout, KindConnection, KindServer, KindCanceled, KindOther}
}

// Kind sorts a fault of the fast tier into a small set of kinds, for
// metrics and alerts.
func Kind(err error) string {
	var rerr redis.Error
	var nerr net.Error
	switch {
	case errors.Is(err, gobreaker.ErrOpenState), errors.Is(err, gobreaker.ErrTooManyRequests):
		return KindBreakerOpen
	case errors.Is(err, ErrCallerGone), errors.Is(err, context.Canceled):
		return KindCanceled
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &nerr) && nerr.Timeout():
		return KindTimeout
	case errors.As(err, &rerr):
		return KindServer
	case errors.Is(err, redis.ErrClosed), errors.Is(err, redis.ErrPoolTimeout), errors.Is(err, io.EOF),
		errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ECONNRESET),
		errors.Is(err, syscall.EPIPE), errors.As(err, new(*net.OpError)):
		return KindConnection
	}
	return KindOther
}
