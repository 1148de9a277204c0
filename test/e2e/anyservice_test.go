package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/wire"
)

// TestInspectRefusesAScopeWithoutRows: without IDEM_SCOPE, idem inspect
// looked in the payments scope, and answered "not processed", exit 0, for
// another service's processed event. It now refuses a scope of which the
// database holds no row (exit 2), naming the scopes it finds, and --scope
// names the service.
func TestInspectRefusesAScopeWithoutRows(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	pool, orders := testenv.Schema(t) // another service's database: idem's tables only
	env := []string{"DATABASE_URL=" + orders, "IDEM_REDIS_ENABLED=false"}

	r := e.run(env, "inspect", "shp_1")
	require.Equal(t, 2, r.code, r.out)
	require.Contains(t, r.out, "no row of any scope")

	ctx := context.Background()
	_, err := pool.Exec(ctx, `INSERT INTO idem_processed (scope, event_id, payload_hash) VALUES ('orders', 'shp_1', '\x01'), ('billing', 'inv_1', '\x02')`)
	require.NoError(t, err)
	r = e.run(env, "inspect", "shp_1")
	require.Equal(t, 2, r.code, r.out)
	require.Contains(t, r.out, `no dedup or outbox row of scope "payments"`)
	require.Contains(t, r.out, "--scope")
	require.Contains(t, r.out, "Scopes found: billing, orders")
	require.NotContains(t, r.out, "verdict")

	r = e.run(env, "inspect", "--scope", "orders", "shp_1")
	require.Zero(t, r.code, r.out)
	require.Regexp(t, `verdict:\s+processed`, r.out)
	r = e.run(env, "inspect", "shp_2", "--scope", "orders") // after the ID too
	require.Zero(t, r.code, r.out)
	require.Regexp(t, `verdict:\s+not processed`, r.out)
	r = e.run(append(env, "IDEM_SCOPE=orders"), "inspect", "--scope", "billing", "inv_1") // the flag over the variable
	require.Zero(t, r.code, r.out)
	require.Contains(t, r.out, "(scope billing)")

	// A scope with outbox rows alone (its dedup rows pruned) is one.
	_, err = pool.Exec(ctx, `INSERT INTO idem_outbox (scope, event_id, idx, destination, lane, body) VALUES ('mailer', 'm_1', 0, 'smtp', 0, '\x00')`)
	require.NoError(t, err)
	r = e.run(env, "inspect", "--scope", "mailer", "m_2")
	require.Zero(t, r.code, r.out)

	// Many scopes: the first ten by name.
	_, err = pool.Exec(ctx, `INSERT INTO idem_processed (scope, event_id, payload_hash)
		SELECT 's' || lpad(i::text, 2, '0'), 'e', '\x01' FROM generate_series(1, 12) i`)
	require.NoError(t, err)
	r = e.run(env, "inspect", "shp_1")
	require.Equal(t, 2, r.code, r.out)
	require.Contains(t, r.out, "Scopes found (the first 10 by name): billing, mailer, orders, s01, s02, s03, s04, s05, s06, s07, …")
}

// TestToolsTakeTheQueueAndScope: every tool that reads a queue or a scope
// takes --queue or --scope over IDEM_QUEUE and IDEM_SCOPE, and says so in
// its help.
func TestToolsTakeTheQueueAndScope(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	for _, c := range []struct {
		args  []string
		flags []string
	}{
		{[]string{"inspect", "-h"}, []string{"-scope"}},
		{[]string{"dlq", "list", "-h"}, []string{"-queue"}},
		{[]string{"dlq", "show", "-h"}, []string{"-queue", "-scope"}},
		{[]string{"dlq", "replay", "-h"}, []string{"-queue"}},
		{[]string{"dlq", "purge", "-h"}, []string{"-queue"}},
		{[]string{"publish", "-h"}, []string{"-queue"}},
		{[]string{"repartition", "-h"}, []string{"-queue"}},
	} {
		r := e.run(nil, c.args...)
		require.Zero(t, r.code, r.out)
		for _, f := range c.flags {
			require.Contains(t, r.out, f, "idem %v", c.args)
		}
	}

	// Another service's queue, with a dead letter, while IDEM_QUEUE names
	// the test's own.
	other := testenv.Queue(t, e.amqpURL)
	ch := e.channel()
	require.NoError(t, broker.TopologyFor(other, 0).Declare(ch))
	require.NoError(t, ch.Publish("", other+".dlq", false, false, amqp.Publishing{
		Body: []byte(`{}`), Timestamp: time.Now(), DeliveryMode: amqp.Persistent,
		Headers: amqp.Table{wire.HeaderReason: "bad_xml", wire.HeaderEventID: "shp_9", wire.HeaderQueue: other},
	}))
	require.Eventually(t, func() bool { return testenv.QueueDepth(t, e.amqpURL, other+".dlq") == 1 }, 10*time.Second, 20*time.Millisecond)
	r := e.run(nil, "dlq", "list", "--queue", other)
	require.Zero(t, r.code, r.out)
	require.Contains(t, r.out, other+".dlq: 1 dead letters")
	r = e.run(nil, "dlq", "show", "--queue", other, "--scope", "orders", "--event", "shp_9")
	require.Zero(t, r.code, r.out)
	require.Regexp(t, `event_id:\s+shp_9\n`, r.out)
	r = e.run(nil, "dlq", "replay", "--queue", other, "--all")
	require.Zero(t, r.code, r.out)
	require.Contains(t, r.out, "replayed 1 dead letters to "+other+";")
	require.Equal(t, 1, testenv.QueueDepth(t, e.amqpURL, other))

	// publish and repartition on that queue.
	r = e.run(nil, "publish", "--queue", other, "--count", "3", "--dup-ratio", "0", "--quiet")
	require.Zero(t, r.code, r.out)
	require.Equal(t, 4, testenv.QueueDepth(t, e.amqpURL, other))
	r = e.run(nil, "repartition", "--queue", other, "--to", "2")
	require.Equal(t, 1, r.code, r.out)
	require.Contains(t, r.out, other+": 4 message(s)")
	r = e.run(nil, "dlq", "purge", "--queue", other, "--yes")
	require.Zero(t, r.code, r.out)
	require.Contains(t, r.out, "from "+other+".dlq")
}

// TestMigrateCreatesIdemsTablesOnly: idem migrate created the payments
// demo's tables in whatever database it was pointed at. It now creates
// idem's own, and the reference handlers' only when the handler setting
// names one; it says which sets it applied.
func TestMigrateCreatesIdemsTablesOnly(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	pool, team := testenv.EmptySchema(t)
	tables := func() []string {
		rows, err := pool.Query(context.Background(), `SELECT tablename FROM pg_tables WHERE schemaname = current_schema() ORDER BY 1`)
		require.NoError(t, err)
		var out []string
		for rows.Next() {
			var n string
			require.NoError(t, rows.Scan(&n))
			out = append(out, n)
		}
		return out
	}
	r := e.run([]string{"DATABASE_URL=" + team}, "migrate")
	require.Zero(t, r.code, r.out)
	require.Contains(t, r.out, "database: applied idem_migrations 0001_idem_processed")
	require.Contains(t, r.out, "database is up to date: idem_migrations\n")
	require.Contains(t, r.out, "not applied: payments_migrations")
	require.Equal(t, []string{"idem_horizon", "idem_instance", "idem_migrations", "idem_outbox", "idem_outbox_lane", "idem_outbox_pause", "idem_processed", "idem_shard", "idem_stream"}, tables())

	r = e.run([]string{"DATABASE_URL=" + team, "IDEM_HANDLER=payments"}, "migrate")
	require.Zero(t, r.code, r.out)
	require.Contains(t, r.out, "database: applied payments_migrations 0001_payments")
	require.Contains(t, r.out, "database is up to date: idem_migrations, payments_migrations\n")
	require.NotContains(t, r.out, "not applied")
	require.Contains(t, tables(), "payments_ledger")
}

// TestForgottenMigrationsStopTheBinaryPlainly: idem consume and idem relay
// with --no-migrate on a database nobody migrated say so, and what to do,
// rather than failing on a missing table in a later check; so do the
// tools.
func TestForgottenMigrationsStopTheBinaryPlainly(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	_, empty := testenv.EmptySchema(t)
	env := []string{"DATABASE_URL=" + empty, "IDEM_CONSUMER_STARTUP_TIMEOUT=30s"}

	r := e.run(env, "consume", "--no-migrate")
	require.Equal(t, 1, r.code, r.out)
	require.Contains(t, r.out, "idem's tables are missing in this database")
	require.Contains(t, r.out, "run `idem migrate`, or start without --no-migrate")
	require.NotContains(t, r.out, "shard's place")
	r = e.run(append(env, "IDEM_OUTBOX_DESTINATIONS=receipts=queue:"+e.queue), "relay", "--no-migrate")
	require.Equal(t, 1, r.code, r.out)
	require.Contains(t, r.out, "idem's tables are missing in this database")
	require.Contains(t, r.out, "run `idem migrate`, or start without --no-migrate")
	for _, tool := range [][]string{{"prune"}, {"repartition", "--to", "2"}} {
		r = e.run(env, tool...)
		require.Equal(t, 1, r.code, r.out)
		require.Contains(t, r.out, "idem's tables are missing in this database", "idem %v", tool)
		require.Contains(t, r.out, "run `idem migrate`", "idem %v", tool)
	}

	// idem's tables, not the payments handler's that idem consume runs.
	r = e.run(env, "migrate")
	require.Zero(t, r.code, r.out)
	r = e.run(env, "consume", "--no-migrate")
	require.Equal(t, 1, r.code, r.out)
	require.Contains(t, r.out, "the service's migrations (set payments_migrations) are not applied")
	require.Contains(t, r.out, "IDEM_HANDLER=payments")
}

// TestARedisDatabaseTheServerLacksIsASetting: a REDIS_URL naming a database
// number the server lacks was taken for a Redis that is down, for ever:
// every call failed, the breaker stayed open. idem consume now refuses it
// at start as a setting to fix (exit 2), naming redis_url and not the
// password.
func TestARedisDatabaseTheServerLacksIsASetting(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	const password = "Zq7redisdb"
	bad := fmt.Sprintf("redis://default:%s@%s/9999", password, redisAddr(t))
	r := e.run([]string{"REDIS_URL=" + bad}, "consume")
	require.Equal(t, 2, r.code, r.out)
	require.Contains(t, r.out, "redis_url (REDIS_URL)")
	require.Contains(t, r.out, "SELECT 9999")
	require.NotContains(t, r.out, password)
	require.NotContains(t, r.out, "msg=consuming")
}

// redisAddr is the shared Redis's host:port.
func redisAddr(t *testing.T) string {
	rdb, _ := testenv.Redis(t)
	return rdb.Options().Addr
}
