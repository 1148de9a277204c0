package e2e

import (
	"context"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/wire"
)

// TestToolsWorkForAnyHandler: idem inspect and idem dlq on a service that
// is not the reference payments handler. inspect reports the guard's tiers
// in a schema without payments_ledger (it failed with "relation does not
// exist" before); the dead-letter tools find a dead letter by the event ID
// the consumer put in its headers, and take the handler's own reason.
func TestToolsWorkForAnyHandler(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	pool, orders := testenv.Schema(t) // the guard's tables only
	_, err := pool.Exec(context.Background(), `INSERT INTO idem_processed (scope, event_id, payload_hash) VALUES ('orders', 'shp_1', '\x0102')`)
	require.NoError(t, err)
	env := []string{"DATABASE_URL=" + orders, "IDEM_SCOPE=orders", "IDEM_REDIS_ENABLED=false"}

	r := e.run(env, "inspect", "shp_1")
	require.Zero(t, r.code, r.out)
	require.Regexp(t, `dedup row:\s+processed .*payload hash 0102`, r.out)
	// Without inspect.effects, no line about a table this service lacks.
	require.NotContains(t, r.out, "effects")
	require.NotContains(t, r.out, "payments_ledger")
	require.Regexp(t, `verdict:\s+processed: its dedup row committed`, r.out)
	r = e.run(env, "inspect", "shp_2")
	require.Zero(t, r.code, r.out)
	require.Regexp(t, `verdict:\s+not processed`, r.out)

	// inspect.effects declares how the service's effects are shown: its
	// rows for the event, counted in the verdict, read only.
	_, err = pool.Exec(context.Background(), `CREATE TABLE shipments (event_id text, carrier text, weight int);
		INSERT INTO shipments VALUES ('shp_1', 'dhl', 3)`)
	require.NoError(t, err)
	declared := append(env, "IDEM_INSPECT_EFFECTS=SELECT carrier, weight FROM shipments WHERE event_id = $1")
	r = e.run(declared, "inspect", "shp_1")
	require.Zero(t, r.code, r.out)
	require.Regexp(t, `effect row 1:\s+carrier dhl, weight 3\n`, r.out)
	require.Regexp(t, `verdict:\s+processed once`, r.out)
	_, err = pool.Exec(context.Background(), `INSERT INTO shipments VALUES ('shp_1', 'ups', 3)`)
	require.NoError(t, err)
	r = e.run(declared, "inspect", "shp_1")
	require.Zero(t, r.code, r.out)
	require.Regexp(t, `verdict:\s+APPLIED 2 TIMES`, r.out)
	r = e.run(append(env, "IDEM_INSPECT_EFFECTS=DELETE FROM shipments WHERE event_id = $1"), "inspect", "shp_1")
	require.NotZero(t, r.code, r.out)
	require.Contains(t, r.out, "read-only transaction")
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM shipments`).Scan(&n))
	require.Equal(t, 2, n, "the declared query runs read only")

	// A dead letter as the consumer writes it for any handler: its body is
	// the service's own, the ID and the reason are in the headers.
	ch := e.channel()
	require.NoError(t, broker.TopologyFor(e.queue, 0).Declare(ch))
	require.NoError(t, ch.Publish("", e.queue+".dlq", false, false, amqp.Publishing{
		Body: []byte(`<shipment id="shp_9"/>`), Timestamp: time.Now(), DeliveryMode: amqp.Persistent,
		Headers: amqp.Table{wire.HeaderReason: "bad_xml", wire.HeaderEventID: "shp_9", wire.HeaderError: "not JSON", wire.HeaderQueue: e.queue},
	}))
	require.Eventually(t, func() bool { return testenv.QueueDepth(t, e.amqpURL, e.queue+".dlq") == 1 }, 10*time.Second, 20*time.Millisecond)
	r = e.run(nil, "dlq", "show", "--event", "shp_9")
	require.Zero(t, r.code, r.out)
	require.Regexp(t, `event_id:\s+shp_9\n`, r.out)
	require.Regexp(t, `reason:\s+bad_xml\n`, r.out)
	r = e.run(nil, "dlq", "purge", "--reason", "bad_xlm", "--yes") // a typo
	require.Equal(t, 2, r.code, r.out)
	require.Contains(t, r.out, `"bad_xlm" matched no dead letter`)
	r = e.run(nil, "dlq", "replay", "--reason", "bad_xml")
	require.Zero(t, r.code, r.out)
	require.Contains(t, r.out, "replayed 1 dead letters")
}
