package e2e

import (
	"context"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/crashpoint"
	"github.com/idemhq/idem/internal/loadgen"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/step"
	"github.com/idemhq/idem/internal/testenv"
)

// newPoolerEnv is newEnv with PostgreSQL reached through a PgBouncer of the
// test's own (transaction pooling unless o says otherwise), in front of a
// database of the test's own on the shared server: a transaction pooler
// passes no search_path, so the test's tables are in that database's
// public schema. e.pool reaches the database directly, to check the
// ledger; the consumers and tools reach it through the pooler only.
func newPoolerEnv(t *testing.T, o sandbox.PgBouncerOptions) (*env, *sandbox.PgBouncer) {
	t.Helper()
	testenv.Shared(t)
	// A transaction pooler passes no search_path: the test's tables are
	// in a database of its own.
	direct, _ := testenv.Database(t)
	u, err := url.Parse(direct)
	require.NoError(t, err)
	db := u.Path[1:]
	b := testenv.PgBouncer(t, o)
	pool, err := pgxpool.New(context.Background(), direct)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	e := &env{t: t, pool: pool, amqpURL: testenv.AMQPURL(), queue: testenv.Queue(t, testenv.AMQPURL()), dir: t.TempDir()}
	e.appName = "idem_" + testenv.Name(t)
	_, prefix := testenv.Redis(t)
	e.vars = testenv.ConsumerVars(testenv.WithParam(b.URL(db), "application_name", e.appName), e.amqpURL, testenv.RedisURL(), e.queue, prefix)
	t.Cleanup(func() {
		for _, p := range e.procs {
			p.Kill()
		}
		if t.Failed() {
			testenv.DumpLogs(t, e.procs)
		}
	})
	return e, b
}

// TestThroughPgBouncerTheDefaultURLWorks: three consumers reach PostgreSQL
// through a transaction-mode PgBouncer with the URL an operator would give
// (no exec mode set). Every event is applied once, and not one statement
// fails: pgx's cache of prepared statements, on a pooler that hands each
// transaction whichever server connection is free, made claims fail with
// "prepared statement ... does not exist" (26000) or "already exists"
// (42P05), each spending an attempt while the consumer said it was ready.
func TestThroughPgBouncerTheDefaultURLWorks(t *testing.T) {
	t.Parallel()
	e, _ := newPoolerEnv(t, sandbox.PgBouncerOptions{})
	m := e.publish(1500, 0.25)
	for i := range 3 {
		e.waitConsuming(e.consume("c" + strconv.Itoa(i)))
	}
	e.waitApplied(m)
	totals := e.stopAll()
	e.requireExactlyOnce(m)
	for _, p := range e.procs {
		b, err := os.ReadFile(p.LogPath)
		require.NoError(t, err)
		require.NotContains(t, string(b), "prepared statement", p.Name)
		require.NotContains(t, string(b), "SQLSTATE", p.Name)
		// No session bound reaches a pooled session: the role must set
		// them, and the consumer says which and how.
		require.Contains(t, string(b), "where idem sets no session setting", p.Name)
		require.Contains(t, string(b), "ALTER ROLE postgres SET idle_in_transaction_session_timeout = '15000ms'", p.Name)
	}
	require.Zero(t, totals["requeued"], "%v", totals)

	// A URL that asks for named prepared statements is refused at start,
	// with what to set.
	var dbURL string
	for _, v := range e.vars {
		if u, ok := strings.CutPrefix(v, "DATABASE_URL="); ok {
			dbURL = u
		}
	}
	r := e.run([]string{"DATABASE_URL=" + dbURL + "&default_query_exec_mode=cache_statement"}, "migrate")
	require.NotEqual(t, 0, r.code, r.out)
	require.Contains(t, r.out, "set default_query_exec_mode=cache_describe", r.out)
}

// TestThroughPgBouncerBothHopsAndTheToolsWork runs the two hops behind a
// transaction-mode PgBouncer: payments consumers that relay receipts, a
// receipts fleet that relays to an API, a consumer SIGKILLed after a
// commit. Every payment has one receipt and the API acts once on each; no
// outbox row is dead; the relays poll (a pooler passes no LISTEN) and say
// so. Then every tool through the same pooler: migrate, inspect, outbox
// list, prune, verify.
func TestThroughPgBouncerBothHopsAndTheToolsWork(t *testing.T) {
	t.Parallel()
	e, _ := newPoolerEnv(t, sandbox.PgBouncerOptions{})
	a := newAPI(t)
	receipts := testenv.Queue(t, e.amqpURL)
	e.vars = append(e.vars,
		"IDEM_OUTBOX_DESTINATIONS=receipts=queue:"+receipts+" mailer="+a.url,
		"IDEM_OUTBOX_POLL_INTERVAL=100ms", "IDEM_OUTBOX_BACKOFF_MIN=20ms", "IDEM_OUTBOX_BACKOFF_MAX=200ms")
	receiptsEnv := []string{"IDEM_HANDLER=receipts", "IDEM_SCOPE=receipts", "IDEM_QUEUE=" + receipts, "IDEM_OUTBOX_EMIT=mailer", "IDEM_OUTBOX_RELAY=true"}
	payments := []string{"IDEM_OUTBOX_EMIT=receipts", "IDEM_OUTBOX_RELAY=true"}
	e.waitConsuming(e.consume("receipts-0", receiptsEnv...))
	m := e.publish(600, 0.25)
	victim := e.consume("payments-victim", append(payments, crashpoint.EnvAt+"="+step.Committed, crashpoint.EnvAfter+"=100")...)
	e.waitKilled(victim, step.Committed)
	e.consume("payments-0", payments...)
	e.consume("receipts-1", receiptsEnv...)
	e.waitApplied(m)
	var got, distinct int
	require.Eventually(t, func() bool {
		require.NoError(t, e.pool.QueryRow(context.Background(),
			`SELECT count(*), count(DISTINCT payment_id) FROM receipts`).Scan(&got, &distinct))
		keys, _ := a.counts()
		return distinct == len(m.Events) && keys == len(m.Events)
	}, 90*time.Second, 100*time.Millisecond, "receipts %d of %d", distinct, len(m.Events))
	require.Equal(t, distinct, got, "no payment has two receipts")
	require.Len(t, a.acted, len(m.Events), "the API acted once per receipt")
	e.stopAll()
	e.requireExactlyOnce(m)
	require.Zero(t, e.outboxStates()["dead"])
	for _, p := range e.procs {
		b, err := os.ReadFile(p.LogPath)
		require.NoError(t, err)
		require.NotContains(t, string(b), "prepared statement", p.Name)
		if p != victim {
			require.Contains(t, string(b), "which LISTEN cannot pass: the relay polls", p.Name)
		}
	}

	for _, args := range [][]string{
		{"migrate"},
		{"inspect", m.Events[0].EventID},
		{"outbox", "list", "-n", "5"},
		{"prune"},
		{"verify", "--manifest", filepath.Join(e.dir, "manifest-0.json")},
	} {
		r := e.run(nil, args...)
		require.Equal(t, 0, r.code, "idem %v: %s", args, r.out)
		require.NotContains(t, r.out, "prepared statement", args)
	}
}

// TestPgBouncerPausedReconnectedAndKilledMidStream: three consumers reach
// PostgreSQL through a transaction-mode PgBouncer while events stream in;
// its admin console PAUSEs it for two seconds (every query waits), RESUMEs
// it, RECONNECTs its server connections, and then it is SIGKILLed and
// started again on its port. Every event is applied exactly once, nothing
// is dead-lettered, the queue ends empty, and every consumer drains and
// exits cleanly.
func TestPgBouncerPausedReconnectedAndKilledMidStream(t *testing.T) {
	t.Parallel()
	e, b := newPoolerEnv(t, sandbox.PgBouncerOptions{})
	for i := range 3 {
		e.waitConsuming(e.consume("c" + strconv.Itoa(i)))
	}
	path := filepath.Join(e.dir, "manifest-0.json")
	e.nextID++
	pub, out := e.command(context.Background(), nil, "publish", "--quiet", "--count", "2400", "--users", "20",
		"--dup-ratio", "0.25", "--delay-window", "200", "--rate", "300", "--manifest", path)
	require.NoError(t, pub.Start())
	ctx := context.Background()
	time.Sleep(2 * time.Second)
	require.NoError(t, b.Admin(ctx, "PAUSE"))
	time.Sleep(2 * time.Second)
	require.NoError(t, b.Admin(ctx, "RESUME"))
	time.Sleep(time.Second)
	require.NoError(t, b.Admin(ctx, "RECONNECT"))
	time.Sleep(time.Second)
	require.NoError(t, b.Restart())
	require.NoError(t, pub.Wait(), out.String())
	m, err := loadgen.ReadManifest(path)
	require.NoError(t, err)
	e.waitApplied(m)
	totals := e.stopAll()
	e.requireExactlyOnce(m)
	require.Zero(t, totals["dead_lettered"], "%v", totals)
	require.Equal(t, 0, testenv.QueueDepth(t, e.amqpURL, e.queue+".dlq"))
}
