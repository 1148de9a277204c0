// Package testenv gives each test its own slice of the real services: a
// Postgres schema, a Redis key prefix, RabbitMQ queue names, and, for tests
// that must kill Redis, a private redis-server. Everything is removed when the
// test ends, so tests run in parallel and leave nothing behind.
package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/migrations"
)

// URLs of the shared services, from the environment or the local defaults.
func DatabaseURL() string {
	return getenv("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
}
func RedisURL() string { return getenv("REDIS_URL", "redis://127.0.0.1:6379/0") }
func AMQPURL() string  { return getenv("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/") }

func getenv(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

// Name returns a short unique name for the test's resources, e.g. "t3f9a1c2d".
func Name(t testing.TB) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return "t" + hex.EncodeToString(b[:])
}

// Schema creates a fresh schema with the guard's tables and those of sets on
// the shared server and returns a pool and a DATABASE_URL confined to it
// (search_path), for child processes.
func Schema(t testing.TB, sets ...migrations.Set) (*pgxpool.Pool, string) {
	return SchemaOn(t, DatabaseURL(), sets...)
}

// SchemaOn is Schema on the server at dbURL.
func SchemaOn(t testing.TB, dbURL string, sets ...migrations.Set) (*pgxpool.Pool, string) {
	t.Helper()
	pool, u := emptySchemaOn(t, dbURL)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, set := range append([]migrations.Set{migrations.Guard}, sets...) {
		if _, err := migrations.ApplySet(ctx, pool, set); err != nil {
			t.Fatalf("testenv: migrate %s: %v", set.Ledger, err)
		}
	}
	return pool, u
}

// EmptySchema is Schema without any tables.
func EmptySchema(t testing.TB) (*pgxpool.Pool, string) { return emptySchemaOn(t, DatabaseURL()) }

func emptySchemaOn(t testing.TB, dbURL string) (*pgxpool.Pool, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	schema := Name(t)
	admin, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatalf("testenv: connect to postgres: %v", err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatalf("testenv: create schema: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		c, err := pgx.Connect(ctx, dbURL)
		if err != nil {
			t.Logf("testenv: drop schema %s: %v", schema, err)
			return
		}
		defer c.Close(ctx)
		if _, err := c.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE"); err != nil {
			t.Logf("testenv: drop schema %s: %v", schema, err)
		}
	})
	u := WithParam(dbURL, "search_path", schema)
	pool, err := pgxpool.New(ctx, u)
	if err != nil {
		t.Fatalf("testenv: pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool, u
}

// WithParam returns rawURL with query parameter k set to v.
func WithParam(rawURL, k, v string) string { return sandbox.WithParam(rawURL, k, v) }

// Redis returns a client on the shared Redis and a key prefix of the test's
// own; the prefix's keys are deleted at the end.
func Redis(t testing.TB) (*redis.Client, string) {
	t.Helper()
	opt, err := redis.ParseURL(RedisURL())
	if err != nil {
		t.Fatalf("testenv: REDIS_URL: %v", err)
	}
	opt.ContextTimeoutEnabled = true
	rdb := redis.NewClient(opt)
	prefix := Name(t)
	t.Cleanup(func() {
		DeletePrefix(rdb, prefix)
		rdb.Close()
	})
	return rdb, prefix
}

// DeletePrefix removes every key starting with prefix.
func DeletePrefix(rdb *redis.Client, prefix string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	iter := rdb.Scan(ctx, 0, prefix+":*", 1000).Iterator()
	var keys []string
	for iter.Next(ctx) {
		keys = append(keys, iter.Val())
		if len(keys) == 1000 {
			rdb.Del(ctx, keys...)
			keys = keys[:0]
		}
	}
	if len(keys) > 0 {
		rdb.Del(ctx, keys...)
	}
}

// Queue returns a queue name of the test's own and deletes the queue, its
// dead-letter queue and exchange from amqpURL's vhost at the end.
func Queue(t testing.TB, amqpURL string) string {
	t.Helper()
	q := "idem.test." + Name(t)
	t.Cleanup(func() {
		if err := sandbox.DeleteQueue(amqpURL, q); err != nil {
			t.Logf("testenv: %v", err)
		}
	})
	return q
}

// QueueDepth returns the ready messages in queue, or -1 if it does not exist.
// Tests poll it, every 10 to 50 ms: it asks over one connection per test
// and broker (an Inspector, reopened after an error and closed at the end of
// the test), not over a connection per look, each of which costs the broker
// a few milliseconds of CPU.
func QueueDepth(t testing.TB, amqpURL, queue string) int {
	t.Helper()
	n, err := inspector(t, amqpURL).Ready(queue)
	if errors.Is(err, sandbox.ErrNoQueue) {
		return -1
	}
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	return n
}

type inspectorKey struct {
	t       testing.TB
	amqpURL string
}

// inspectors holds each test's Inspectors, by test and broker URL.
var inspectors sync.Map

// inspector returns t's Inspector for amqpURL, opened on first use and
// closed at the end of t.
func inspector(t testing.TB, amqpURL string) *sandbox.Inspector {
	key := inspectorKey{t, amqpURL}
	if in, ok := inspectors.Load(key); ok {
		return in.(*sandbox.Inspector)
	}
	in, loaded := inspectors.LoadOrStore(key, sandbox.NewInspector(amqpURL))
	if !loaded {
		t.Cleanup(func() {
			inspectors.Delete(key)
			in.(*sandbox.Inspector).Close()
		})
	}
	return in.(*sandbox.Inspector)
}
