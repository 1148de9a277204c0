package idem_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/idem"
)

// TestAPasswordChangedUnderARunningServiceIsNotReadyNotFatal: the
// service's RabbitMQ password changes while it consumes, and its link
// drops. Run does not return: /readyz turns 503 saying why, each refusal
// counts in idem_broker_refusals_total (IdemBrokerRefused reads it), for
// longer than a refusal is given at start; once the password is back, it
// consumes again. Before, the first reconnect ended Run with
// ErrBrokerRefused.
func TestAPasswordChangedUnderARunningServiceIsNotReadyNotFatal(t *testing.T) {
	t.Parallel()
	userURL, setPassword := testenv.User(t, testenv.AMQPURL())
	parsed, err := url.Parse(userURL)
	require.NoError(t, err)
	password, _ := parsed.User.Password()
	u, err := amqp.ParseURI(testenv.AMQPURL())
	require.NoError(t, err)
	proxy, err := sandbox.StartAMQPCut(u.Host + ":" + strconv.Itoa(u.Port))
	require.NoError(t, err)
	t.Cleanup(proxy.Close)

	pool, _ := testenv.Schema(t)
	_, err = pool.Exec(context.Background(), `CREATE TABLE greetings (name text NOT NULL)`)
	require.NoError(t, err)
	queue := testenv.Queue(t, testenv.AMQPURL())
	reg := prometheus.NewRegistry()
	svc, err := idem.New(idem.Config{
		Scope:     "greeter",
		Databases: []*pgxpool.Pool{pool},
		Consumer: consumer.Config{URL: proxy.URL(userURL), Queue: queue,
			ReconnectBackoff: consumer.Backoff{Min: 10 * time.Millisecond, Max: 200 * time.Millisecond}},
		Metrics: reg,
		Logger:  testenv.Logger(t),
	}, greeting{})
	require.NoError(t, err)
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx) }()
	t.Cleanup(func() {
		stop()
		require.NoError(t, <-done)
	})
	readyz := func() (int, string) {
		rec := httptest.NewRecorder()
		svc.Health().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
		return rec.Code, rec.Body.String()
	}
	rows := func() int {
		var n int
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM greetings`).Scan(&n))
		return n
	}
	running := func() {
		t.Helper()
		select {
		case err := <-done:
			done <- err // for the cleanup
			t.Fatalf("Run returned while the password was wrong: %v", err)
		default:
		}
	}

	publish(testenv.AMQPURL(), queue, "g1:Ada")
	if !assert.Eventually(t, func() bool { return rows() == 1 }, 30*time.Second, 20*time.Millisecond) {
		t.Fatalf("the first greeting was never applied: %d ready in the queue, %d in its DLQ, stats %+v",
			testenv.QueueDepth(t, testenv.AMQPURL(), queue), testenv.QueueDepth(t, testenv.AMQPURL(), queue+".dlq"), svc.Stats())
	}
	code, _ := readyz()
	require.Equal(t, http.StatusOK, code)

	setPassword("changed")
	proxy.Drop()
	// RabbitMQ answers each bad login three seconds later.
	require.Eventually(t, func() bool { return refusals(t, reg) >= broker.RefusedTries }, time.Minute, 50*time.Millisecond)
	running()
	code, body := readyz()
	require.Equal(t, http.StatusServiceUnavailable, code, body)
	require.Contains(t, body, "consumer: failing: not consuming: RabbitMQ refused the connection or dropped it during the handshake")

	setPassword(password)
	require.Eventually(t, func() bool { code, _ := readyz(); return code == http.StatusOK }, 30*time.Second, 20*time.Millisecond)
	publish(testenv.AMQPURL(), queue, "g2:Grace")
	require.Eventually(t, func() bool { return rows() == 2 }, 30*time.Second, 20*time.Millisecond)
	running()
}

// refusals reads idem_broker_refusals_total.
func refusals(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	families, err := reg.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() == "idem_broker_refusals_total" {
			return f.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatal("no idem_broker_refusals_total")
	return 0
}
