package idem_test

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"testing/fstest"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/migrations"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/idem"
)

// reviewSlowSet is a service's migration set whose one migration takes d
// (a backfill, an index built on a table that already holds rows).
func reviewSlowSet(t *testing.T, d time.Duration) migrations.Set {
	return migrations.Set{Ledger: "review_" + testenv.Name(t), Files: fstest.MapFS{
		"0001_backfill.sql": {Data: []byte("SELECT pg_sleep(" + d.String()[:len(d.String())-1] + ")")},
	}}
}

// reviewStart runs a Service and returns a channel that receives Run's
// error if Run returns before the test ends.
func reviewStart(t *testing.T, cfg idem.Config) <-chan error {
	t.Helper()
	cfg.Logger = slog.New(slog.DiscardHandler)
	if testing.Verbose() {
		cfg.Logger = slog.Default()
	}
	svc, err := idem.New(cfg, ledgerHandler{})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	done := make(chan struct{})
	go func() { defer close(done); errc <- svc.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return errc
}

// TestAMigrationLongerThanTheHandlerTimeoutRunsAtStart: a service
// with Migrate and a migration of its own that takes longer than
// HandlerTimeout + 5 s (here 1 s + 5 s; an index build or a backfill on a
// table with rows takes minutes). Migrations run at start on the service's
// pool, whose sessions pgsession now bounds with statement_timeout =
// HandlerTimeout + 5 s: the migration is cancelled (57014), pgerr.Wait
// takes it as permanent, and Run fails. docs/operations.md says migrations
// get no statement or lock timeout, but only `idem migrate` (a tool's
// pool) keeps that; `idem consume`, `idem relay` and Service.Run migrate
// on bounded pools.
func TestAMigrationLongerThanTheHandlerTimeoutRunsAtStart(t *testing.T) {
	t.Parallel()
	_, dbURL := testenv.Schema(t, testenv.Effects)
	amqpURL := testenv.AMQPURL()
	queue := testenv.Queue(t, amqpURL)
	cons := consumer.Config{URL: amqpURL, Queue: queue, HandlerTimeout: time.Second, BatchSize: 1}
	errc := reviewStart(t, idem.Config{Scope: "pay", DatabaseURL: dbURL, Consumer: cons,
		Migrate: true, Migrations: []migrations.Set{reviewSlowSet(t, 7*time.Second)}})
	select {
	case err := <-errc:
		t.Fatalf("Run returned at start: %v", err)
	case <-time.After(12 * time.Second):
	}
}

// TestAFleetStartingTogetherWaitsForTheMigration: two instances
// start together, both with Migrate (ApplySet: "concurrent callers are
// serialised by an advisory lock, so a fleet may all run it at start").
// The first runs a 2 s migration; the second waits on
// pg_advisory_xact_lock, and lock_timeout (HandlerTimeout / 2 = 0.5 s)
// ends that wait with 55P03, which pgerr.Wait takes as permanent: the
// second instance's Run fails at start.
func TestAFleetStartingTogetherWaitsForTheMigration(t *testing.T) {
	t.Parallel()
	_, dbURL := testenv.Schema(t, testenv.Effects)
	amqpURL := testenv.AMQPURL()
	queue := testenv.Queue(t, amqpURL)
	set := reviewSlowSet(t, 2*time.Second)
	cons := consumer.Config{URL: amqpURL, Queue: queue, HandlerTimeout: time.Second, BatchSize: 1}
	a := reviewStart(t, idem.Config{Scope: "pay", DatabaseURL: dbURL, Consumer: cons, Migrate: true, Migrations: []migrations.Set{set}})
	b := reviewStart(t, idem.Config{Scope: "pay", DatabaseURL: dbURL, Consumer: cons, Migrate: true, Migrations: []migrations.Set{set}})
	deadline := time.After(8 * time.Second)
	for {
		select {
		case err := <-a:
			t.Fatalf("instance A's Run returned at start: %v", err)
		case err := <-b:
			t.Fatalf("instance B's Run returned at start: %v", err)
		case <-deadline:
			return
		}
	}
}

// TestForgottenMigrationsSayWhatToDo: a service started on a database where
// nobody ran the migrations (and without Migrate) fails at once with a
// plain "run idem migrate, or set Migrate", not with a missing table deep
// in a start-up check.
func TestForgottenMigrationsSayWhatToDo(t *testing.T) {
	t.Parallel()
	_, dbURL := testenv.EmptySchema(t)
	errc := reviewStart(t, idem.Config{Scope: "pay", DatabaseURL: dbURL,
		Consumer: consumer.Config{URL: testenv.AMQPURL(), Queue: testenv.Queue(t, testenv.AMQPURL())}})
	select {
	case err := <-errc:
		require.ErrorContains(t, err, "idem's tables are missing")
		require.ErrorContains(t, err, "run `idem migrate`, or set Migrate")
	case <-time.After(30 * time.Second):
		t.Fatal("the service did not stop on a database without idem's tables")
	}
}

// TestAServiceWhoseOwnMigrationsWereNotRunIsTold: idem's tables are there
// but the service's own set was never applied, and Migrate is off: Run
// stops at start naming the set, rather than consuming events whose
// effects have no table to land in.
func TestAServiceWhoseOwnMigrationsWereNotRunIsTold(t *testing.T) {
	t.Parallel()
	_, dbURL := testenv.Schema(t) // idem's tables only
	errc := reviewStart(t, idem.Config{Scope: "pay", DatabaseURL: dbURL, Migrations: []migrations.Set{testenv.Effects},
		Consumer: consumer.Config{URL: testenv.AMQPURL(), Queue: testenv.Queue(t, testenv.AMQPURL())}})
	select {
	case err := <-errc:
		require.ErrorContains(t, err, "the service's migrations (set testenv_migrations) are not applied")
		require.ErrorContains(t, err, "0001_effects")
		require.ErrorContains(t, err, "set Migrate")
	case <-time.After(30 * time.Second):
		t.Fatal("the service started without its own tables")
	}
}

// TestABrokenDeployIsRefusedByTheServicesOwnCheck: idem's start-up checks
// read migration ledgers, so a deploy whose handler needs a column no
// migration made was ready until traffic arrived. Config.CheckReady runs
// the service's own check on each database before the consumer starts: its
// error ends Run, naming the check, with nothing consumed; a check that
// passes lets the service consume.
func TestABrokenDeployIsRefusedByTheServicesOwnCheck(t *testing.T) {
	t.Parallel()
	_, dbURL := testenv.Schema(t, testenv.Effects)
	queue := testenv.Queue(t, testenv.AMQPURL())
	needsColumn := func(ctx context.Context, shard int, db *pgxpool.Pool) error {
		_, err := db.Exec(ctx, `SELECT refunded_at FROM ledger LIMIT 0`)
		return err
	}
	errc := reviewStart(t, idem.Config{Scope: "pay", DatabaseURL: dbURL, CheckReady: needsColumn,
		Consumer: consumer.Config{URL: testenv.AMQPURL(), Queue: queue}})
	select {
	case err := <-errc:
		require.ErrorContains(t, err, "CheckReady on the database")
		require.ErrorContains(t, err, `column "refunded_at" does not exist`)
	case <-time.After(30 * time.Second):
		t.Fatal("the service started though its own check failed")
	}

	var shards []int
	var mu sync.Mutex
	ok := func(ctx context.Context, shard int, db *pgxpool.Pool) error {
		mu.Lock()
		defer mu.Unlock()
		shards = append(shards, shard)
		_, err := db.Exec(ctx, `SELECT event_id FROM ledger LIMIT 0`)
		return err
	}
	errc = reviewStart(t, idem.Config{Scope: "pay", DatabaseURL: dbURL, CheckReady: ok,
		Consumer: consumer.Config{URL: testenv.AMQPURL(), Queue: queue}})
	select {
	case err := <-errc:
		t.Fatalf("the service stopped though its check passed: %v", err)
	case <-time.After(3 * time.Second):
	}
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []int{0}, shards, "called once, for the one database")
}
