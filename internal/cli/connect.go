package cli

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/internal/config"
	"github.com/idemhq/idem/migrations"
	"github.com/idemhq/idem/pkg/consumer"
)

// loadDB reads the config and opens the database pool; close the pool when done.
func (e *env) loadDB(ctx context.Context, path string) (config.Config, *slog.Logger, *pgxpool.Pool, error) {
	cfg, log, err := e.loadConfig(path)
	if err != nil {
		return cfg, nil, nil, err
	}
	pool, err := openPool(ctx, cfg)
	return cfg, log, pool, err
}

func openPool(ctx context.Context, cfg config.Config) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("database_url: %w", err)
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

func openRedis(cfg config.Config) (*redis.Client, error) {
	opt, err := redis.ParseURL(cfg.RedisURL)
	if err != nil {
		return nil, fmt.Errorf("redis_url: %w", err)
	}
	// Per-call deadlines come from the context (redis.timeout); the
	// breaker, not go-redis, decides what to do about failures.
	opt.ContextTimeoutEnabled = true
	opt.MaxRetries = -1
	opt.DialTimeout = time.Second
	opt.ReadTimeout = time.Second
	opt.WriteTimeout = time.Second
	return redis.NewClient(opt), nil
}

// migrateWithRetry applies pending migrations, retrying while Postgres is
// unreachable so that a fleet can start before its database.
func migrateWithRetry(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger) error {
	b := consumer.Backoff{Min: 200 * time.Millisecond, Max: 5 * time.Second}
	for attempt := 1; ; attempt++ {
		mctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		ran, err := migrations.Apply(mctx, pool)
		cancel()
		if err == nil {
			for _, m := range ran {
				log.Info("applied migration", "version", m.Version, "name", m.Name)
			}
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		d := b.Delay(attempt)
		log.Warn("migrate failed, retrying", "err", err, "delay", d)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(d):
		}
	}
}

// redactURL hides a URL's password.
func redactURL(s string) string {
	u, err := url.Parse(s)
	if err != nil || u.User == nil {
		return s
	}
	return u.Redacted()
}
