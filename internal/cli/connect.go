package cli

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/internal/config"
)

// LoadDB reads the config and opens a pool per shard (one for database_url
// when postgres.shards is empty); close them when done.
func (e *Env) LoadDB(ctx context.Context, path string) (config.Config, *slog.Logger, Shards, error) {
	cfg, log, err := e.LoadConfig(path)
	if err != nil {
		return cfg, nil, nil, err
	}
	dbs, err := OpenShards(ctx, cfg)
	return cfg, log, dbs, err
}

// OpenShards opens a pool per shard, or one for database_url.
func OpenShards(ctx context.Context, cfg config.Config) (Shards, error) {
	var dbs Shards
	for i, u := range cfg.DatabaseURLs() {
		pool, err := openPoolAt(ctx, cfg, u)
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

// OpenPool opens the pool database_url describes; tune, if given, may adjust
// its config first (to add a tracer, say).
func OpenPool(ctx context.Context, cfg config.Config, tune ...func(*pgxpool.Config)) (*pgxpool.Pool, error) {
	return openPoolAt(ctx, cfg, cfg.DatabaseURL, tune...)
}

// openPoolAt opens a pool on url, sized and bounded as cfg says.
func openPoolAt(ctx context.Context, cfg config.Config, url string, tune ...func(*pgxpool.Config)) (*pgxpool.Pool, error) {
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
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	return pool, nil
}
