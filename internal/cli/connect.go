package cli

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/internal/config"
	"github.com/idemhq/idem/internal/pgsession"
)

// LoadDB reads the config and opens a pool per shard (one for database_url
// when postgres.shards is empty), its sessions bounded for a tool (see
// LoadDBFor); close them when done.
func (e *Env) LoadDB(ctx context.Context, path string) (config.Config, *slog.Logger, Shards, error) {
	return e.LoadDBFor(ctx, path, nil)
}

// LoadDBFor is LoadDB for a command whose transactions are bounded as
// bounds(cfg) says (consume, relay); nil bounds a tool's sessions.
func (e *Env) LoadDBFor(ctx context.Context, path string, bounds func(config.Config) pgsession.Bounds) (config.Config, *slog.Logger, Shards, error) {
	cfg, log, err := e.LoadConfig(path)
	if err != nil {
		return cfg, nil, nil, err
	}
	var b pgsession.Bounds
	if bounds != nil {
		b = bounds(cfg)
	}
	dbs, err := OpenShards(ctx, cfg, b)
	return cfg, log, dbs, err
}

// ConsumeBounds bounds the sessions of idem consume: its transactions last
// at most consumer.handler_timeout, and a relay's pass (outbox.relay) at
// most outbox.publish_timeout.
func ConsumeBounds(cfg config.Config) pgsession.Bounds {
	tx := cfg.Consumer.HandlerTimeout
	if cfg.Outbox.Relay {
		tx = max(tx, RelayBounds(cfg).Tx)
	}
	return pgsession.Bounds{Tx: tx}
}

// RelayBounds bounds the sessions of idem relay: a pass's transaction lasts
// at most outbox.publish_timeout and a second.
func RelayBounds(cfg config.Config) pgsession.Bounds {
	return pgsession.Bounds{Tx: cfg.Outbox.PublishTimeout + time.Second}
}

// OpenShards opens a pool per shard, or one for database_url, with b's
// session bounds.
func OpenShards(ctx context.Context, cfg config.Config, b pgsession.Bounds) (Shards, error) {
	var dbs Shards
	for i, u := range cfg.DatabaseURLs() {
		pool, err := openPoolAt(ctx, cfg, u, b)
		if err != nil {
			dbs.Close()
			if len(cfg.DatabaseURLs()) > 1 {
				err = fmt.Errorf("postgres.shards: shard %d: %w", i, err)
			}
			return nil, err
		}
		dbs = append(dbs, pool)
	}
	return dbs, nil
}

// Shards are the pools of the authoritative tier's databases, in shard
// order: one when the tier is not sharded.
type Shards []*pgxpool.Pool

// Close closes every pool.
func (s Shards) Close() {
	for _, p := range s {
		p.Close()
	}
}

// name labels shard i in output and errors; empty with one database.
func (s Shards) name(i int) string {
	if len(s) == 1 {
		return ""
	}
	return fmt.Sprintf("shard %d", i)
}

// OpenPool opens the pool database_url describes, bounded as idem consume's;
// tune, if given, may adjust its config first (to add a tracer, say).
func OpenPool(ctx context.Context, cfg config.Config, tune ...func(*pgxpool.Config)) (*pgxpool.Pool, error) {
	return openPoolAt(ctx, cfg, cfg.DatabaseURL, ConsumeBounds(cfg), tune...)
}

// openPoolAt opens a pool on url, sized as cfg says, its sessions bounded
// as b says.
func openPoolAt(ctx context.Context, cfg config.Config, url string, b pgsession.Bounds, tune ...func(*pgxpool.Config)) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("database_url: %w", err)
	}
	for _, t := range tune {
		t(pc)
	}
	pc.MaxConns = cfg.Postgres.MaxConns
	if pc.ConnConfig.ConnectTimeout == 0 || pc.ConnConfig.ConnectTimeout > 5*time.Second {
		pc.ConnConfig.ConnectTimeout = 5 * time.Second
	}
	pgsession.Apply(pc, b)
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	return pool, nil
}
