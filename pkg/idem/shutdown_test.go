package idem_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/idem"
)

// TestShutdownEndsADialTheBrokerHolds: during a broker outage the link
// takes the consumer's connection and goes silent in the handshake, which
// the dial alone would wait out for 30 s (SIGTERM took 25.4 s to exit, close
// to Kubernetes' grace). Cancelling Run ends that dial: Run returns within
// the drain timeout.
func TestShutdownEndsADialTheBrokerHolds(t *testing.T) {
	t.Parallel()
	u, err := amqp.ParseURI(testenv.AMQPURL())
	require.NoError(t, err)
	proxy, err := sandbox.StartAMQPCut(u.Host + ":" + strconv.Itoa(u.Port))
	require.NoError(t, err)
	t.Cleanup(proxy.Close)
	proxy.Arm(sandbox.Cut{Dir: sandbox.ToServer, Method: sandbox.ConnectionStartOk, Stall: true})

	pool, _ := testenv.Schema(t)
	const drain = 2 * time.Second
	svc, err := idem.New(idem.Config{
		Scope:     "greeter",
		Databases: []*pgxpool.Pool{pool},
		Consumer:  consumer.Config{URL: proxy.URL(testenv.AMQPURL()), Queue: testenv.Queue(t, testenv.AMQPURL()), DrainTimeout: drain},
		Logger:    testenv.Logger(t),
	}, greeting{})
	require.NoError(t, err)
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx) }()
	t.Cleanup(func() {
		stop()
		proxy.Close() // a Run still dialling fails at once
		<-done
	})

	require.Eventually(t, func() bool { return proxy.Fired() == 1 }, 30*time.Second, 10*time.Millisecond,
		"the consumer's handshake reached the broker, which went silent")
	stop()
	select {
	case err := <-done:
		done <- err // for the cleanup
		require.NoError(t, err)
	case <-time.After(drain + 3*time.Second):
		t.Fatal("Run went on past the drain timeout: the dial ignores shutdown")
	}
}
