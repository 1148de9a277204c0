package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
)

// poisonHandler applies each event as a ledger row named by its body, and
// rejects the body "poison" at once: it needs a dead letter.
type poisonHandler struct{}

func (poisonHandler) Decode(m consumer.Message) (guard.Event, string, error) {
	return guard.Event{ID: m.ID, Hash: guard.HashFields(string(m.Body))}, string(m.Body), nil
}

func (poisonHandler) Apply(ctx context.Context, tx pgx.Tx, body string) error {
	if body == "poison" {
		return consumer.Reject("poison", errors.New("a poison event"))
	}
	_, err := tx.Exec(ctx, `INSERT INTO ledger (event_id, user_id, amount) VALUES ($1, 'u', 1)`, body)
	return err
}

// TestAStalledPublishingConnectionHoldsOnlyDeadLetters: the consumer's
// publishing connection is lost and every new one stalls in its handshake
// (the consume link healthy). Events that need no publish go on being
// applied and acked; the one that needs a dead letter waits, unacked, up to
// StoreHold, goes back to the queue and comes back to wait again; once the
// link heals it is dead-lettered. Before, the session ended with its
// publishing connection, and each new session waited for a publishing
// handshake that never completed: the consumer took nothing.
func TestAStalledPublishingConnectionHoldsOnlyDeadLetters(t *testing.T) {
	t.Parallel()
	proxy, _ := testenv.AMQPCut(t)
	r := startRig(t, poisonHandler{}, func(cfg *consumer.Config) {
		cfg.URL = proxy.URL(cfg.URL)
		cfg.ConnectionName = "stalled-" + strings.ReplaceAll(t.Name(), "/", "-")
		cfg.BatchSize = 1
		cfg.StoreHold = 2 * time.Second
		cfg.ReconnectBackoff = consumer.Backoff{Min: 10 * time.Millisecond, Max: 200 * time.Millisecond}
	})
	r.publish("evt_0", "evt_0")
	r.requireLedger(1)

	publishing := func(name string) bool { return strings.HasSuffix(name, broker.PublishingConnectionSuffix) }
	proxy.StallWhere(publishing)
	// The publishing connection opens beside the session: on a loaded
	// machine its handshake can reach the proxy after the first event was
	// applied. Stalled at its start-ok, it is dropped once it has.
	require.Eventually(t, func() bool { return proxy.DropWhere(publishing) == 1 }, 10*time.Second, 10*time.Millisecond,
		"the publishing connection")
	r.publish("evt_p", "poison")
	for i := 1; i <= 5; i++ {
		r.publish(fmt.Sprintf("evt_%d", i), fmt.Sprintf("evt_%d", i))
	}
	r.requireLedger(6)
	require.True(t, r.consumerStats().Consuming)
	require.Eventually(t, func() bool { return r.consumerStats().Publishing != "" }, 10*time.Second, 10*time.Millisecond,
		"Stats says the publishing connection is away")
	// The poison waits for a publisher, and goes back to the queue after
	// StoreHold rather than being acked away.
	require.Eventually(t, func() bool { return r.stats["retry"].Load() > 0 }, 30*time.Second, 10*time.Millisecond,
		"the poison handed back after store_hold")
	require.Zero(t, r.stats["dead_lettered"].Load())

	proxy.Release()
	d := r.deadLetter()
	require.Equal(t, "evt_p", d.MessageId)
	require.Equal(t, "poison", d.Headers[wire.HeaderReason])
	require.Eventually(t, func() bool { return r.consumerStats().Publishing == "" }, 30*time.Second, 10*time.Millisecond)
	r.publish("evt_6", "evt_6")
	r.requireLedger(7)
}
