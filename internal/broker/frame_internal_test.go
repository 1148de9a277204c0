package broker

import (
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/wire"
)

// TestFitAddsToAnEarlierList: a letter cut once (a dead letter) and again
// (its replay) names every header it lost, and keeps what keep holds.
func TestFitAddsToAnEarlierList(t *testing.T) {
	p := amqp.Publishing{Headers: amqp.Table{
		HeaderHeadersDropped: "first",
		"second":             strings.Repeat("s", 5000),
		"third":              strings.Repeat("t", 100),
		"x-idem-reason":      "decode_error",
	}}
	dropped, err := fit(&p, 4096, wire.Ours)
	require.NoError(t, err)
	require.Equal(t, []string{"second"}, dropped)
	require.Equal(t, "first, second", p.Headers[HeaderHeadersDropped])
	require.Contains(t, p.Headers, "third")
	require.Equal(t, "decode_error", p.Headers["x-idem-reason"])
	require.LessOrEqual(t, headerFrameSize(p), 4096)

	p = amqp.Publishing{Headers: amqp.Table{"x-idem-error": strings.Repeat("e", 5000), "other": "o"}}
	_, err = fit(&p, 4096, wire.Ours)
	require.Error(t, err, "what keep holds is too large by itself")
	require.Contains(t, p.Headers, "other", "a message that cannot fit is left as it was")
}

// TestTheDroppedListIsBounded: however many headers go, their list stays
// short.
func TestTheDroppedListIsBounded(t *testing.T) {
	h := amqp.Table{}
	for i := range 2000 {
		h[strings.Repeat("n", 40)+string(rune('a'+i%26))+strings.Repeat("x", i/26)] = strings.Repeat("v", 60)
	}
	p := amqp.Publishing{Headers: h}
	dropped, err := fit(&p, 8192, func(string) bool { return false })
	require.NoError(t, err)
	require.NotEmpty(t, dropped)
	require.LessOrEqual(t, len(p.Headers[HeaderHeadersDropped].(string)), maxDroppedList)
	require.LessOrEqual(t, headerFrameSize(p), 8192)
}
