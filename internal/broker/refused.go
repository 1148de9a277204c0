package broker

import (
	"context"
	"errors"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// ErrRefused: RabbitMQ kept refusing the connection (see IsRefused) for as
// long as a refusal is given at start (RefusedTries, over RefusedFor): a
// setting to fix, not an outage to wait out.
var ErrRefused = errors.New("RabbitMQ refused the connection")

// IsRefused reports whether err is RabbitMQ refusing a connection, or a
// connection dropped during its handshake: 403 ACCESS_REFUSED (bad
// credentials, a missing permission) or 530 NOT_ALLOWED (a vhost missing or
// forbidden, a per-user or per-vhost connection limit). amqp091 reports a
// socket that closed at login, or at connection.open, as bad credentials
// or vhost (amqp.ErrCredentials, amqp.ErrVhost, both 403), and a broker
// restarting or a network fault closes it just so: one refusal proves
// nothing, only one that lasts does (see Refusals).
func IsRefused(err error) bool {
	var ae *amqp.Error
	return errors.As(err, &ae) && (ae.Code == amqp.AccessRefused || ae.Code == amqp.NotAllowed)
}

// Explain says what a refusal (IsRefused) may be, for logs and readiness.
func Explain(err error) error {
	return fmt.Errorf("RabbitMQ refused the connection or dropped it during the handshake (if it lasts, check the URL's user, password and vhost): %w", err)
}

// Lasting is ErrRefused with the refusal that ended the wait.
func Lasting(err error) error {
	return fmt.Errorf("%w (check the URL's user, password and vhost): %w", ErrRefused, err)
}

// A refusal lasts once RefusedTries attempts in a row were refused, the
// first at least RefusedFor before the last: a few tries over a few
// seconds, which a broker restarting or a dropped link does not survive.
const (
	RefusedTries = 3
	RefusedFor   = 3 * time.Second
)

// Refusals counts the refusals in a row of attempts to connect.
type Refusals struct {
	n     int
	first time.Time
}

// Add records the outcome of an attempt that ended at now, and reports
// whether the refusals in a row have lasted. Any outcome but a refusal
// starts the count again.
func (r *Refusals) Add(err error, now time.Time) bool {
	if !IsRefused(err) {
		*r = Refusals{}
		return false
	}
	if r.n == 0 {
		r.first = now
	}
	r.n++
	return r.n >= RefusedTries && now.Sub(r.first) >= RefusedFor
}

// DialAtStart is DialContext for a connection that a command or process
// starts with: a refusal is dialled again, after a short backoff, until it
// lasts (Refusals), so that a broker restarting is not taken for a bad
// password.
// A refusal that lasts is ErrRefused; any other error is returned at once,
// as is the last refusal when ctx ends.
func DialAtStart(ctx context.Context, urls []string, start int, cfg amqp.Config) (*amqp.Connection, int, error) {
	var refusals Refusals
	wait := refusedRetryMin
	for {
		conn, i, err := DialContext(ctx, urls, start, cfg)
		switch {
		case err == nil || !IsRefused(err):
			return conn, i, err
		case refusals.Add(err, time.Now()):
			return nil, 0, Lasting(err)
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, 0, Explain(err)
		case <-t.C:
		}
		wait = min(2*wait, refusedRetryMax)
	}
}

// DialAtStart's backoff between refusals.
const (
	refusedRetryMin = 100 * time.Millisecond
	refusedRetryMax = time.Second
)
