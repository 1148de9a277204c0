package outbox_test

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/layout"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/outbox"
)

// enqueue commits n events, each with one message To to, through a guard.
func enqueue(t *testing.T, db *pgxpool.Pool, to string, n int) {
	t.Helper()
	g, err := guard.New(guard.Config{Scope: "pay", Store: pgtier.New(db)})
	require.NoError(t, err)
	for i := range n {
		id := fmt.Sprintf("e%d", i)
		_, err := g.Process(context.Background(), guard.Event{ID: id, Hash: guard.HashFields(id)}, func(ctx context.Context, tx pgx.Tx) error {
			return outbox.Enqueue(ctx, tx, outbox.Message{EventID: id, To: to, Key: id, Type: "SHIPPED", Body: []byte(id)})
		})
		require.NoError(t, err)
	}
}

// declare declares queue's stream as its consumers do.
func declare(t *testing.T, queue string) {
	t.Helper()
	conn, err := amqp.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, broker.TopologyFor(queue, 0).Declare(ch))
}

// runRelay runs r until the test ends or stop is called; stop returns
// Run's error, and fails the test if Run outlasts its bound.
func runRelay(t *testing.T, r *outbox.Relay) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	var err error
	var stopped bool
	stop = func() error {
		if !stopped {
			stopped = true
			cancel()
			select {
			case err = <-done:
			case <-time.After(15 * time.Second):
				t.Fatal("Run did not return once its context ended")
			}
		}
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

// TestARelayOfItsOwnPublishesToAQueue: a service that runs its relay apart
// from its consumers, on its own pool: every message reaches the stream's
// queue once, with its message ID, and Run returns nil when its context
// ends.
func TestARelayOfItsOwnPublishesToAQueue(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Schema(t)
	queue := testenv.Queue(t, testenv.AMQPURL())
	declare(t, queue)
	const n = 25
	enqueue(t, db, "shipments", n)
	reg := prometheus.NewRegistry()
	r, err := outbox.NewRelay(outbox.RelayConfig{
		Databases:    []*pgxpool.Pool{db},
		AMQPURL:      testenv.AMQPURL(),
		Destinations: map[string]outbox.Destination{"shipments": {Queue: queue}},
		PollInterval: 50 * time.Millisecond,
		Metrics:      reg,
		Logger:       testenv.Logger(t),
	})
	require.NoError(t, err)
	require.ErrorContains(t, r.Ready(), "not started")
	stop := runRelay(t, r)

	conn, err := amqp.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	seen := map[string]int{}
	require.Eventually(t, func() bool {
		d, ok, err := ch.Get(queue, true)
		require.NoError(t, err)
		if ok {
			seen[d.MessageId]++
			require.Equal(t, "SHIPPED", d.Type)
		}
		return len(seen) == n
	}, 30*time.Second, 5*time.Millisecond, "the relay published %d of %d", len(seen), n)
	for i := range n {
		require.Equal(t, 1, seen[outbox.ID("pay", fmt.Sprintf("e%d", i), 0)])
	}
	require.Eventually(t, func() bool { return r.Ready() == nil }, 10*time.Second, 10*time.Millisecond)
	var sent int
	require.Eventually(t, func() bool {
		require.NoError(t, db.QueryRow(context.Background(), `SELECT count(*) FROM idem_outbox WHERE state = 'sent'`).Scan(&sent))
		return sent == n
	}, 10*time.Second, 10*time.Millisecond, "rows kept, sent, for the retention")
	mfs, err := reg.Gather()
	require.NoError(t, err)
	require.NotEmpty(t, mfs, "the relay's metrics are registered")
	require.NoError(t, stop())
}

// TestARelayRefusesAQueueDestinationOfAnotherPartitionCount: the database
// records the stream with one partition; a destination that names two
// would route a key's messages to a queue nobody reads. Run says so, at
// once.
func TestARelayRefusesAQueueDestinationOfAnotherPartitionCount(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Schema(t)
	queue := testenv.Queue(t, testenv.AMQPURL())
	_, err := layout.CheckPartitions(context.Background(), db, queue, 1)
	require.NoError(t, err)
	r, err := outbox.NewRelay(outbox.RelayConfig{
		Databases:    []*pgxpool.Pool{db},
		AMQPURL:      testenv.AMQPURL(),
		Destinations: map[string]outbox.Destination{"shipments": {Queue: queue, Partitions: 2}},
		Logger:       testenv.Logger(t),
	})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = r.Run(ctx)
	require.ErrorContains(t, err, "partition count differs")
	require.NoError(t, ctx.Err(), "Run waited instead of saying so")
}

// TestNewRelayNamesWhatIsWrong: each bad setting is NewRelay's error,
// naming the destination and the field; a URL's password and a header's
// value never appear in it.
func TestNewRelayNamesWhatIsWrong(t *testing.T) {
	const secret = "Zq7sentinelTOKEN"
	db, err := pgxpool.New(context.Background(), "postgres://127.0.0.1:1/none") // connects on first use: never here
	require.NoError(t, err)
	defer db.Close()
	dbs := []*pgxpool.Pool{db}
	amqpURL := "amqp://guest:guest@127.0.0.1:5672/"
	one := func(d outbox.Destination) map[string]outbox.Destination {
		return map[string]outbox.Destination{"api": d}
	}
	for _, tc := range []struct {
		name string
		cfg  outbox.RelayConfig
		want string
	}{
		{"no database", outbox.RelayConfig{Destinations: one(outbox.Destination{URL: "https://api.example.com"})}, "outbox: Databases is required"},
		{"no destination", outbox.RelayConfig{Databases: dbs}, "outbox: Destinations is required"},
		{"none of the three", outbox.RelayConfig{Databases: dbs, Destinations: one(outbox.Destination{})},
			`outbox: destination "api": set exactly one of Queue, Exchange and URL`},
		{"two of the three", outbox.RelayConfig{Databases: dbs, AMQPURL: amqpURL, Destinations: one(outbox.Destination{Queue: "q", URL: "https://api.example.com"})},
			`destination "api": set exactly one`},
		{"a header on a queue", outbox.RelayConfig{Databases: dbs, AMQPURL: amqpURL, Destinations: one(outbox.Destination{Queue: "q", Header: http.Header{"X": {"y"}}})},
			`destination "api": Header, Request and FinalStatuses are for a URL destination`},
		{"final statuses on a queue", outbox.RelayConfig{Databases: dbs, AMQPURL: amqpURL, Destinations: one(outbox.Destination{Queue: "q", FinalStatuses: []int{400}})},
			`destination "api": Header, Request and FinalStatuses are for a URL destination`},
		{"a 2xx as final", outbox.RelayConfig{Databases: dbs, Destinations: one(outbox.Destination{URL: "https://api.example.com", FinalStatuses: []int{400, 200}})},
			`destination "api": FinalStatuses: 200: want 300 to 599`},
		{"a routing key on a queue", outbox.RelayConfig{Databases: dbs, AMQPURL: amqpURL, Destinations: one(outbox.Destination{Queue: "q", RoutingKey: "k"})},
			`destination "api": RoutingKey is for an Exchange destination`},
		{"partitions out of range", outbox.RelayConfig{Databases: dbs, AMQPURL: amqpURL, Destinations: one(outbox.Destination{Queue: "q", Partitions: 2000})},
			`destination "api": Partitions 2000: want 0 to 1024`},
		{"a queue without a broker", outbox.RelayConfig{Databases: dbs, Destinations: one(outbox.Destination{Queue: "q"})},
			`destination "api": AMQPURL is required`},
		{"not an http URL", outbox.RelayConfig{Databases: dbs, Destinations: one(outbox.Destination{URL: "ftp://u:" + secret + "@files.example.com/in"})},
			`destination "api": URL "ftp://u:xxxxx@files.example.com/in": want an absolute http or https URL`},
		{"idem's own header", outbox.RelayConfig{Databases: dbs, Destinations: one(outbox.Destination{URL: "https://api.example.com",
			Header: http.Header{"idempotency-key": {secret}}})},
			`destination "api": Header: Idempotency-Key: idem or net/http sets this header itself`},
		{"a header net/http sets", outbox.RelayConfig{Databases: dbs, Destinations: one(outbox.Destination{URL: "https://api.example.com",
			Header: http.Header{"host": {secret}}})},
			`destination "api": Header: Host: idem or net/http sets this header itself`},
		{"an X-Idem- header", outbox.RelayConfig{Databases: dbs, Destinations: one(outbox.Destination{URL: "https://api.example.com",
			Header: http.Header{"X-Idem-Tenant": {secret}}})},
			`destination "api": Header: X-Idem-Tenant: idem or net/http sets this header itself`},
		{"a header value that cannot be sent", outbox.RelayConfig{Databases: dbs, Destinations: one(outbox.Destination{URL: "https://api.example.com",
			Header: http.Header{"Authorization": {"Bearer " + secret + "\r\nX-Injected: 1"}}})},
			`destination "api": Header: Authorization: a value holds a control character`},
		{"a bad header name", outbox.RelayConfig{Databases: dbs, Destinations: one(outbox.Destination{URL: "https://api.example.com",
			Header: http.Header{"Bad Name": {secret}}})},
			`destination "api": Header: "Bad Name" is not a valid header name`},
		{"a bad broker URL", outbox.RelayConfig{Databases: dbs, AMQPURL: "amqp://u:" + secret + "@host:port/", Destinations: one(outbox.Destination{Exchange: "x"})},
			"outbox: AMQPURL:"},
		{"a bad batch size", outbox.RelayConfig{Databases: dbs, BatchSize: 5000, Destinations: one(outbox.Destination{URL: "https://api.example.com"})},
			"outbox: BatchSize 5000: want 1 to 4096"},
		{"not a status", outbox.RelayConfig{Databases: dbs, DoneStatus: 42, Destinations: one(outbox.Destination{URL: "https://api.example.com"})},
			"outbox: DoneStatus 42 is not an HTTP status"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := outbox.NewRelay(tc.cfg)
			require.ErrorContains(t, err, tc.want)
			require.NotContains(t, err.Error(), secret)
		})
	}
	_, err = outbox.NewRelay(outbox.RelayConfig{Databases: dbs, AMQPURL: amqpURL, Destinations: map[string]outbox.Destination{
		"events":  {Queue: "orders.events", Partitions: 4},
		"audit":   {Exchange: "audit", RoutingKey: "orders"},
		"carrier": {URL: "https://u:" + secret + "@carrier.example.com/v1", Header: http.Header{"X-Api-Key": {secret}}},
	}})
	require.NoError(t, err, "one of each kind")
}
