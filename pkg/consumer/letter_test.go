package consumer

import (
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/wire"
)

// TestADeadLetterCarriesNoForgedIdemHeaders: a producer's x-idem-* headers,
// in any case, do not reach the dead letter, where the tools would take a
// forged x-idem-event-id for the event's; its other headers do, and so do a
// replay's count and ID, of their types. Nor does a forged x-death: the
// tools would take the letter for the broker's.
func TestADeadLetterCarriesNoForgedIdemHeaders(t *testing.T) {
	got := letterHeaders(amqp.Table{
		"x-idem-event-id":     "evt_victim",
		"x-idem-payload-hash": "00ff",
		"X-Idem-Reason":       "handler_failed",
		"X-IDEM-SHARD-KEY":    "k",
		"x-idem-dlq-fence":    "f",
		"x-delivery-count":    int64(3),
		"x-death":             []any{amqp.Table{"reason": "rejected", "queue": "q"}},
		"x-first-death-queue": "q",
		"x-last-death-reason": "rejected",
		"x-idem-replays":      int64(2),
		"x-idem-replay-id":    "run-1",
		"traceparent":         "00-abc-def-01",
		"x-idem":              "not in the namespace",
	})
	require.Equal(t, amqp.Table{
		"x-idem-replays":   int64(2),
		"x-idem-replay-id": "run-1",
		"traceparent":      "00-abc-def-01",
		"x-idem":           "not in the namespace",
	}, got)

	got = letterHeaders(amqp.Table{wire.HeaderReplays: "9\nreason: x", wire.HeaderReplayID: int32(1)})
	require.Empty(t, got, "a replay's headers of another type are forged")
}
