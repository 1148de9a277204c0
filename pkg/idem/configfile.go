package idem

import (
	"errors"
	"fmt"
	"net/url"
	"os"
	"strconv"

	"github.com/idemhq/idem/internal/config"
)

// LoadConfig reads the settings file the idem tools read with --config
// (idem.example.yaml's format; empty path: none), with the IDEM_* variables
// over it as the tools read them, into a Config: Scope, the database,
// Redis, Fast, Consumer and PruneInterval. A service that loads its
// settings so, from the file it gives its operators' tools, cannot
// disagree with them on the scope, the Redis prefix or the queue. The
// rest (a handler's Migrations, Outbox, Metrics, Logger, CheckReady) is
// the service's to add.
//
// The settings are checked as the tools check them. With postgres.shards
// it refuses: open a pool per shard and set Databases. Redis, when
// redis.enabled, is a client opened here (any redis.mode, with the file's
// TLS settings), which the caller closes once Run has returned.
func LoadConfig(path string) (Config, error) {
	c, err := config.Load(path, os.Environ())
	if err != nil {
		return Config{}, err
	}
	urls := c.DatabaseURLs()
	if len(urls) != 1 {
		return Config{}, errors.New("idem: LoadConfig: postgres.shards lists several databases: open a pool on each and set Databases")
	}
	out := Config{
		Scope:         c.Scope,
		DatabaseURL:   withPoolSize(urls[0], int(c.Postgres.MaxConns)),
		Fast:          c.FastConfig(),
		Consumer:      c.ConsumerConfig(),
		PruneInterval: c.Postgres.PruneInterval,
	}
	if c.Redis.Enabled {
		if out.Redis, err = c.RedisClient(); err != nil {
			return Config{}, fmt.Errorf("idem: LoadConfig: redis: %w", err)
		}
	}
	return out, nil
}

// withPoolSize adds postgres.max_conns to dsn as pool_max_conns, unless it
// sets one.
func withPoolSize(dsn string, n int) string {
	if hasParam(dsn, "pool_max_conns") {
		return dsn
	}
	if u, err := url.Parse(dsn); err == nil && u.Scheme != "" {
		q := u.Query()
		q.Set("pool_max_conns", strconv.Itoa(n))
		u.RawQuery = q.Encode()
		return u.String()
	}
	return dsn + " pool_max_conns=" + strconv.Itoa(n)
}
