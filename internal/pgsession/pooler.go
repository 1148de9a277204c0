package pgsession

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A transaction-mode pooler (PgBouncer's pool_mode = transaction, RDS
// Proxy without pinning, Supavisor, pgcat) hands each transaction, and each
// statement outside one, whichever server connection is free, and keeps a
// server connection's session state when another client takes it. pgx's
// default caches named prepared statements per client connection, so
// through such a pooler a statement meets a server connection that lacks it
// ("prepared statement ... does not exist", 26000) or already has it from
// another client ("... already exists", 42P05). idem finds the pooler at
// start and, unless the URL chose an exec mode itself, runs its pools
// without named prepared statements (pgx's cache_describe: the same single
// round trip per statement, the server parses each), and sets no session
// setting on its connections (one would land on whichever server
// connection the pooler lent, and stay there for its next clients): set
// them on the role (ALTER ROLE … SET).

// ExecModeParam is the URL parameter that chooses pgx's exec mode.
const ExecModeParam = "default_query_exec_mode"

// PoolerExecMode is the exec mode idem picks behind a transaction pooler.
const PoolerExecMode = pgx.QueryExecModeCacheDescribe

// probeTimeout bounds the probe: a pooler whose pool is exhausted makes
// the second connection wait for a server.
const probeTimeout = 5 * time.Second

// Probe reports whether a and b, two client connections to the same
// database, do not each have a session of their own: a named statement or
// a session setting a made is visible to b, or not (or no longer) to a, or
// either's backend changes between its statements. On a direct connection
// (or a session-mode pooler) none can happen. Through a transaction-mode
// pooler that keeps its most recently used server connection first
// (PgBouncer's default), b sees a's; one that resets each server
// connection after use (server_reset_query_always), or renames prepared
// statements (PgBouncer's max_prepared_statements), hides a's own from a.
// Probe looks three times.
func Probe(ctx context.Context, a, b *pgx.Conn) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	token := fmt.Sprintf("%016x", rand.Uint64())
	name := "idem_pooler_probe_" + token
	type view struct {
		pid     int32
		stmt    bool   // the probe's named statement is in this session
		setting string // the probe's session setting, as this session has it
	}
	look := func(c *pgx.Conn) (view, error) {
		var v view
		err := c.QueryRow(ctx, `SELECT pg_backend_pid(), EXISTS (SELECT 1 FROM pg_prepared_statements WHERE name = '`+name+`'),
			coalesce(current_setting('idem.pooler_probe', true), '')`, pgx.QueryExecModeSimpleProtocol).Scan(&v.pid, &v.stmt, &v.setting)
		return v, err
	}
	a1, err := look(a)
	if err != nil {
		return sharedState(err)
	}
	b1, err := look(b)
	if err != nil {
		return sharedState(err)
	}
	if _, err := a.Exec(ctx, `SELECT set_config('idem.pooler_probe', '`+token+`', false)`, pgx.QueryExecModeSimpleProtocol); err != nil {
		return sharedState(err)
	}
	if _, err := a.Prepare(ctx, name, "SELECT 1"); err != nil {
		return sharedState(err)
	}
	defer func() { _ = a.Deallocate(context.WithoutCancel(ctx), name) }()
	for range 3 {
		b2, err := look(b)
		if err != nil {
			return sharedState(err)
		}
		a2, err := look(a)
		if err != nil {
			return sharedState(err)
		}
		if b2.stmt || b2.setting == token || !a2.stmt || a2.setting != token || a2.pid != a1.pid || b2.pid != b1.pid {
			return true, nil
		}
	}
	return false, nil
}

// sharedState reads a probe's error: one about a prepared statement means
// a server session carried another client's statements.
func sharedState(err error) (bool, error) {
	if PreparedStatementError(err) {
		return true, nil
	}
	return false, fmt.Errorf("probe for a transaction pooler: %w", err)
}

// PreparedStatementError reports whether err is a named prepared
// statement missing (26000) or already there (42P05): behind a
// transaction-mode pooler, the sign that pgx's statement cache meets
// other clients' server sessions.
func PreparedStatementError(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && (pe.Code == "26000" || pe.Code == "42P05") && strings.Contains(pe.Message, "prepared statement")
}

// PoolerHint is what to tell an operator whose URL set an exec mode that
// a transaction pooler breaks.
const PoolerHint = "a transaction-mode pooler (PgBouncer pool_mode=transaction or alike) is between idem and PostgreSQL, and this exec mode prepares named statements on server sessions it shares between clients: set " + ExecModeParam + "=cache_describe (or exec, or simple_protocol) in the database URL, or point idem at PostgreSQL or at a session-mode pool"

// pooler is what a pool's connections learnt of a transaction pooler:
// a new connection probes (on two connections of its own) until one probe
// has answered, and every later one reads the answer; one made while a
// probe is under way waits for it, within its own context. While no probe
// has answered, a new connection prepares nothing by name (safe either
// way) and sets the session bounds (a direct connection needs them;
// through a pooler they only reach its server connections).
type pooler struct {
	mu      sync.Mutex
	probed  bool          // a probe answered
	pooled  bool          // its answer
	probing chan struct{} // closed when the probe under way ends; nil: none
	setMode bool          // the URL chose the exec mode itself
}

// beforeConnect probes if no probe has answered and none is under way
// and, behind a transaction pooler (or while it is not known), sets the new
// connection's exec mode to PoolerExecMode; it refuses with PoolerHint if
// the URL chose a mode that prepares named statements and a pooler is
// known. A probe that fails never fails the connection: the connection's
// own dial says what is wrong.
func (p *pooler) beforeConnect(ctx context.Context, cc *pgx.ConnConfig) error {
	p.mu.Lock()
	wait, probe := p.probing, false
	if !p.probed && wait == nil {
		p.probing, probe = make(chan struct{}), true
	}
	p.mu.Unlock()
	switch {
	case probe:
		pooled, err := probeConfig(ctx, cc)
		p.mu.Lock()
		if err == nil {
			p.probed, p.pooled = true, pooled
		}
		close(p.probing)
		p.probing = nil
		p.mu.Unlock()
	case wait != nil:
		select {
		case <-wait:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	p.mu.Lock()
	known, pooled := p.probed, p.pooled
	p.mu.Unlock()
	switch {
	case known && !pooled:
	case !p.setMode:
		cc.DefaultQueryExecMode = PoolerExecMode
	case known && cc.DefaultQueryExecMode == pgx.QueryExecModeCacheStatement:
		return errors.New(PoolerHint)
	}
	return nil
}

// fitted are the poolers of the pools Apply fitted, by connection string:
// pools on one URL reach the server the same way.
var fitted sync.Map // string -> *pooler

// Known returns what the probe of a pool Apply fitted found, once one of
// its connections was made: known is false for a pool Apply did not fit,
// or whose probe has not answered.
func Known(pool *pgxpool.Pool) (pooled, known bool) {
	v, ok := fitted.Load(pool.Config().ConnString())
	if !ok {
		return false, false
	}
	p := v.(*pooler)
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.pooled, p.probed
}

// knownPooled reports whether a probe found a transaction pooler.
func (p *pooler) knownPooled() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.probed && p.pooled
}

// probeConfig runs Probe on two connections of cc's own.
func probeConfig(ctx context.Context, cc *pgx.ConnConfig) (bool, error) {
	cc = cc.Copy()
	cc.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	cc.Tracer = nil // the probe is no statement of the pool's users
	a, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return false, err
	}
	defer a.Close(context.WithoutCancel(ctx))
	if direct(ctx, a) {
		return false, nil // nothing in between: no second connection
	}
	b, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return false, err
	}
	defer b.Close(context.WithoutCancel(ctx))
	return Probe(ctx, a, b)
}

// direct reports whether c's TCP connection ends at the server itself: the
// server sees it come from the port it leaves here. Anything in between (a
// pooler, a proxy, NAT) shows another port, and a Unix socket none: then
// only Probe can tell.
func direct(ctx context.Context, c *pgx.Conn) bool {
	local, ok := c.PgConn().Conn().LocalAddr().(*net.TCPAddr)
	if !ok {
		return false
	}
	var port *int32
	if err := c.QueryRow(ctx, `SELECT inet_client_port()`, pgx.QueryExecModeSimpleProtocol).Scan(&port); err != nil || port == nil {
		return false
	}
	return int(*port) == local.Port
}

// PoolIsPooled is Probe on two connections of its own, made as pool's
// are (not taken from pool, which may have none to spare).
func PoolIsPooled(ctx context.Context, pool *pgxpool.Pool) (bool, error) {
	return probeConfig(ctx, pool.Config().ConnConfig)
}

// ErrPooledStatements is CheckPool's refusal.
var ErrPooledStatements = errors.New(PoolerHint)

// CheckPool returns ErrPooledStatements if pool's connections prepare
// named statements (pgx's default exec mode) and it reaches PostgreSQL
// through a transaction-mode pooler: a pool a service made itself, which
// Apply did not fit.
func CheckPool(ctx context.Context, pool *pgxpool.Pool) error {
	if !NamedStatements(ctx, pool) {
		return nil
	}
	pooled, err := PoolIsPooled(ctx, pool)
	if err == nil && pooled {
		err = ErrPooledStatements
	}
	return err
}

// NamedStatements reports whether pool's connections prepare named
// statements: pgx's default exec mode, as the pool's config or, on one of
// its connections, a BeforeConnect set it.
func NamedStatements(ctx context.Context, pool *pgxpool.Pool) bool {
	mode := pool.Config().ConnConfig.DefaultQueryExecMode
	actx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	if c, err := pool.Acquire(actx); err == nil {
		mode = c.Conn().Config().DefaultQueryExecMode
		c.Release()
	}
	return mode == pgx.QueryExecModeCacheStatement
}

// HasParam reports whether the database URL or DSN sets param.
func HasParam(dsn, param string) bool {
	if u, err := url.Parse(dsn); err == nil && u.Scheme != "" {
		return u.Query().Has(param)
	}
	return strings.Contains(dsn, param+"=")
}

// UnsetBounds returns the settings of b that nothing set on pool's server
// sessions (the role, the database, the server): behind a transaction
// pooler Apply sets none there, so an orphaned session would hold its locks
// until the pooler noticed. role is current_user.
func UnsetBounds(ctx context.Context, pool *pgxpool.Pool, b Bounds) (unset []string, role string, err error) {
	var names []string
	for k := range b.Params() {
		if !strings.HasPrefix(k, "tcp_") { // the pooler's own link to the server
			names = append(names, k)
		}
	}
	slices.Sort(names)
	rows, err := pool.Query(ctx, `SELECT name, current_user FROM pg_settings WHERE name = ANY($1) AND source = 'default' ORDER BY name`, names)
	if err != nil {
		return nil, "", err
	}
	defer rows.Close()
	for rows.Next() {
		var n string
		if err := rows.Scan(&n, &role); err != nil {
			return nil, "", err
		}
		unset = append(unset, n)
	}
	return unset, role, rows.Err()
}
