package cli

import (
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/console"
	"github.com/idemhq/idem/internal/dlq"
)

// TestAConsoleActionTakesNoMoreThanThePageShowed: a group's action takes at
// most the letters the page counted and none dead-lettered after the
// newest it showed; a ticked letter is named by more than its message ID,
// which producers choose and reuse.
func TestAConsoleActionTakesNoMoreThanThePageShowed(t *testing.T) {
	t0 := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	letter := func(id string, at time.Time, body string) dlq.Message {
		return dlq.Message{D: amqp.Delivery{MessageId: id, Type: "PAYMENT_COMPLETED", Body: []byte(body)},
			Reason: "handler_failed", DeadLetteredAt: at}
	}
	old1, old2 := letter("m", t0, "a"), letter("m", t0.Add(time.Second), "b")
	newer := letter("m", t0.Add(time.Minute), "c")
	pick := picks(console.Selection{Reason: "handler_failed", Type: "PAYMENT_COMPLETED", Max: 2, Before: t0.Add(time.Second)})
	require.False(t, pick(newer), "arrived after the page was read")
	require.True(t, pick(old1))
	require.True(t, pick(old2))
	require.False(t, pick(letter("m", t0, "d")), "more than the page counted")

	require.NotEqual(t, letterKey(old1), letterKey(old2), "one message ID, two letters")
	pick = picks(console.Selection{Keys: []string{letterKey(old2)}, Max: 1})
	require.False(t, pick(old1))
	require.True(t, pick(old2))
	require.False(t, pick(old2), "one ticked: one taken")
	other := old2
	other.Reason = "payload_conflict"
	require.NotEqual(t, letterKey(old2), letterKey(other), "another group's letter with the same message ID and body")
}
