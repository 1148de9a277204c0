package pgsession

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
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
// database, share server sessions: a named statement a prepares is visible
// to b, or either's backend changes between its statements. On a direct
// connection (or a session-mode pooler) neither can happen. A
// transaction-mode pooler that keeps its most recently used server
// connection first (PgBouncer's default) shows it at once; Probe looks three
// times.
func Probe(ctx context.Context, a, b *pgx.Conn) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	name := fmt.Sprintf("idem_pooler_probe_%016x", rand.Uint64())
	pid := func(c *pgx.Conn) (int32, bool, error) {
		var p int32
		var seen bool
		err := c.QueryRow(ctx, `SELECT pg_backend_pid(), EXISTS (SELECT 1 FROM pg_prepared_statements WHERE name = '`+name+`')`,
			pgx.QueryExecModeSimpleProtocol).Scan(&p, &seen)
		return p, seen, err
	}
	a1, _, err := pid(a)
	if err != nil {
		return sharedState(err)
	}
	b1, _, err := pid(b)
	if err != nil {
		return sharedState(err)
	}
	for range 3 {
		if _, err := a.Prepare(ctx, name, "SELECT 1"); err != nil {
			return sharedState(err)
		}
		b2, seen, err := pid(b)
		if err != nil {
			return sharedState(err)
		}
		a2, _, err := pid(a)
		if err != nil {
			return sharedState(err)
		}
		if seen || a2 != a1 || b2 != b1 {
			return true, nil
		}
		_ = a.Deallocate(ctx, name)
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
// the first new connection probes (on two connections of its own), and
// every later one reads the answer.
type pooler struct {
	mu      sync.Mutex
	probed  bool
	pooled  bool
	setMode bool // the URL chose the exec mode itself
}

// beforeConnect probes once (until a probe succeeds) and, behind a
// transaction pooler, sets the new connection's exec mode to
// PoolerExecMode; it refuses with PoolerHint if the URL chose a mode that
// prepares named statements.
func (p *pooler) beforeConnect(ctx context.Context, cc *pgx.ConnConfig) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.probed {
		pooled, err := probeConfig(ctx, cc)
		if err != nil {
			return err
		}
		p.probed, p.pooled = true, pooled
	}
	switch {
	case !p.pooled:
	case !p.setMode:
		cc.DefaultQueryExecMode = PoolerExecMode
	case cc.DefaultQueryExecMode == pgx.QueryExecModeCacheStatement:
		return errors.New(PoolerHint)
	}
	return nil
}

func (p *pooler) isPooled() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.pooled
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
	b, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return false, err
	}
	defer b.Close(context.WithoutCancel(ctx))
	return Probe(ctx, a, b)
}

// PoolIsPooled is Probe on two connections of pool (one it cannot get
// within the probe's bound: it reports no pooler).
func PoolIsPooled(ctx context.Context, pool *pgxpool.Pool) (bool, error) {
	pooled, _, err := probePool(ctx, pool)
	return pooled, err
}

// ErrPooledStatements is CheckPool's refusal.
var ErrPooledStatements = errors.New(PoolerHint)

// CheckPool returns ErrPooledStatements if pool reaches PostgreSQL through
// a transaction-mode pooler and its connections prepare named statements
// (pgx's default exec mode): a pool a service made itself, which Apply did
// not fit.
func CheckPool(ctx context.Context, pool *pgxpool.Pool) error {
	pooled, mode, err := probePool(ctx, pool)
	if err == nil && pooled && mode == pgx.QueryExecModeCacheStatement {
		err = ErrPooledStatements
	}
	return err
}

func probePool(ctx context.Context, pool *pgxpool.Pool) (bool, pgx.QueryExecMode, error) {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	a, err := pool.Acquire(ctx)
	if err != nil {
		return false, 0, err
	}
	defer a.Release()
	mode := a.Conn().Config().DefaultQueryExecMode
	b, err := pool.Acquire(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return false, mode, nil
		}
		return false, mode, err
	}
	defer b.Release()
	pooled, err := Probe(ctx, a.Conn(), b.Conn())
	return pooled, mode, err
}

// HasParam reports whether the database URL or DSN sets param.
func HasParam(dsn, param string) bool {
	if u, err := url.Parse(dsn); err == nil && u.Scheme != "" {
		return u.Query().Has(param)
	}
	return strings.Contains(dsn, param+"=")
}
