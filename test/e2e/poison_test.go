package e2e

import (
	"fmt"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/crashpoint"
	"github.com/idemhq/idem/internal/testenv"
)

// TestMessageThatKillsEveryConsumerIsDeadLetteredByTheBroker: no consumer
// ever reaches a decision on a message that crashes it, so the quorum
// queue's x-delivery-limit must dead-letter it (at-least-once), not drop it
// and not let it block the queue forever.
func TestMessageThatKillsEveryConsumerIsDeadLetteredByTheBroker(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	e.vars = append(e.vars, "IDEM_CONSUMER_DELIVERY_LIMIT=2", "IDEM_CONSUMER_BROKER_DELIVERY_LIMIT=3",
		"IDEM_CONSUMER_PREFETCH=1", "IDEM_CONSUMER_BATCH_SIZE=1", "IDEM_CONSUMER_WORKERS=1")
	e.brokerLimit = 3
	e.publishRaw(body(`{"eventId":"evt_poison","userId":"user_1","type":"PAYMENT_COMPLETED","amount":5}`))

	dlq := func() int { return testenv.QueueDepth(t, e.amqpURL, e.queue+".dlq") }
	step := string(crashpoint.Steps[2])
	deaths := 0
	for dlq() == 0 {
		require.Less(t, deaths, 10, "the broker never dead-lettered the message")
		p := e.consume(fmt.Sprintf("victim-%d", deaths), crashpoint.EnvAt+"="+step)
		// The broker dead-letters asynchronously after the last death, so
		// a new victim may find the queue empty: wait for either.
		require.Eventually(t, func() bool {
			select {
			case <-p.Done():
				return true
			default:
				return dlq() > 0
			}
		}, 60*time.Second, 20*time.Millisecond)
		select {
		case <-p.Done():
			e.waitKilled(p, step)
			deaths++
		default:
			// A SIGTERM that lands before the process has set up its
			// signal handling kills it outright: let it start first.
			e.waitConsuming(p)
			if err := p.Stop(30 * time.Second); err != nil {
				// It took the message and died of it after all: the
				// broker's dead-lettering lags its last deliveries.
				e.waitKilled(p, step)
				deaths++
			}
		}
	}
	letters := e.deadLetters(1)
	deaths0, ok := letters[0].Headers["x-death"].([]any)
	require.True(t, ok, "x-death header: %v", letters[0].Headers)
	first, ok := deaths0[0].(amqp.Table)
	require.True(t, ok, "x-death entry: %v", deaths0[0])
	require.Equal(t, "delivery_limit", first["reason"])
	require.Zero(t, e.ledgerRows(), "the crashed attempts must all have rolled back")
	t.Logf("dead-lettered by the broker after %d consumer deaths", deaths)
}
