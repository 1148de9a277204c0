// Package pgsession bounds every PostgreSQL session idem opens, on both
// ends of the link, so that a half-open connection (packets dropped, no
// reset) never leaves a session behind that holds locks:
//
//   - server side, set on each session where nothing else set them (the
//     server's configuration, the role, the database, the URL):
//     idle_in_transaction_session_timeout, statement_timeout and
//     lock_timeout, derived from the longest a healthy transaction of
//     idem's takes; TCP keepalives and tcp_user_timeout, so the server
//     notices a client that vanished;
//   - client side: TCP keepalives and TCP_USER_TIMEOUT on the socket, so a
//     silent server is noticed even between transactions.
//
// A session the server ends this way rolls back, and its row locks go with
// it: the event it held is claimed by whoever retries it.
package pgsession

import (
	"context"
	"fmt"
	"net"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The TCP bounds: a peer silent for KeepaliveIdle, then unanswered for
// KeepaliveCount probes KeepaliveInterval apart, or data unacknowledged for
// UserTimeout, ends the connection.
const (
	KeepaliveIdle     = 5 * time.Second
	KeepaliveInterval = 5 * time.Second
	KeepaliveCount    = 3
	UserTimeout       = 20 * time.Second
)

// Bounds says how long a healthy transaction of the pool's users lasts.
type Bounds struct {
	// Tx is the longest a healthy transaction takes (the consumer's
	// HandlerTimeout, a relay's PublishTimeout): idle in a transaction
	// longer than Tx plus a margin, or in one statement, and the server
	// ends the session. 0 sets only the TCP bounds and an
	// idle-in-transaction timeout of DefaultIdleInTx (for tools whose
	// statements may run long, such as migrations).
	Tx time.Duration
}

// DefaultIdleInTx bounds an idle transaction of a pool with no Tx bound.
const DefaultIdleInTx = time.Minute

// margin is what a healthy transaction may take beyond Tx: a commit after
// the handler's deadline, a slow round trip.
const margin = 5 * time.Second

// Params returns the session settings b stands for, by name.
func (b Bounds) Params() map[string]string {
	ms := func(d time.Duration) string { return fmt.Sprint(d.Milliseconds()) }
	p := map[string]string{
		"idle_in_transaction_session_timeout": ms(DefaultIdleInTx),
		"tcp_keepalives_idle":                 fmt.Sprint(int(KeepaliveIdle.Seconds())),
		"tcp_keepalives_interval":             fmt.Sprint(int(KeepaliveInterval.Seconds())),
		"tcp_keepalives_count":                fmt.Sprint(KeepaliveCount),
		"tcp_user_timeout":                    ms(UserTimeout),
	}
	if b.Tx > 0 {
		p["idle_in_transaction_session_timeout"] = ms(b.Tx + margin)
		p["statement_timeout"] = ms(b.Tx + margin)
		// Below Tx, so that a claim waiting on a dedup row another
		// session holds hears it from the server before its own deadline,
		// and the consumer holds the delivery instead of spending an
		// attempt.
		p["lock_timeout"] = ms(b.Tx / 2)
	}
	return p
}

// setUnset sets each setting that nothing else set: not the server's
// configuration, the role or database (ALTER ROLE … SET), nor the URL (a
// parameter or options=-c). One round trip per new connection.
const setUnset = `SELECT count(set_config(s.name, b.value, false))
FROM unnest($1::text[], $2::text[]) AS b(name, value)
JOIN pg_settings s ON s.name = b.name
WHERE s.source = 'default'`

// Apply bounds the sessions of pc's pool as b says: on each new connection
// it sets b's settings that nothing else set, and it dials TCP with
// keepalives and TCP_USER_TIMEOUT. Behind a transaction-mode pooler (see
// Probe) it sets no session setting and, unless the URL chose an exec
// mode, uses PoolerExecMode. A transaction may lift a bound for
// itself (SET LOCAL statement_timeout = 0), as migrations do.
func Apply(pc *pgxpool.Config, b Bounds) {
	var names, values []string
	for k, v := range b.Params() {
		names, values = append(names, k), append(values, v)
	}
	p := &pooler{setMode: HasParam(pc.ConnString(), ExecModeParam)}
	fitted.Store(pc.ConnString(), p)
	before := pc.BeforeConnect
	pc.BeforeConnect = func(ctx context.Context, cc *pgx.ConnConfig) error {
		if before != nil {
			if err := before(ctx, cc); err != nil {
				return err
			}
		}
		return p.beforeConnect(ctx, cc)
	}
	next := pc.AfterConnect
	pc.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
		if !p.knownPooled() {
			if _, err := conn.Exec(ctx, setUnset, names, values); err != nil {
				return fmt.Errorf("bound the session: %w", err)
			}
		}
		if next != nil {
			return next(ctx, conn)
		}
		return nil
	}
	d := &net.Dialer{
		Timeout: pc.ConnConfig.ConnectTimeout,
		KeepAliveConfig: net.KeepAliveConfig{
			Enable: true, Idle: KeepaliveIdle, Interval: KeepaliveInterval, Count: KeepaliveCount,
		},
		Control: func(network, _ string, c syscall.RawConn) error {
			if !strings.HasPrefix(network, "tcp") {
				return nil // a Unix socket: no TCP to bound
			}
			var serr error
			err := c.Control(func(fd uintptr) { serr = setUserTimeout(fd, UserTimeout) })
			if err != nil {
				return err
			}
			return serr
		},
	}
	pc.ConnConfig.DialFunc = d.DialContext
}
