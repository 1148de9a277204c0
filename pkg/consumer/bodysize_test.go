package consumer_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
)

// decodeCounter is handlerFunc counting the Decode calls of each message ID.
type decodeCounter struct {
	handlerFunc
	mu      sync.Mutex
	decoded map[string]int
}

func (h *decodeCounter) Decode(m consumer.Message) (guard.Event, []byte, error) {
	h.mu.Lock()
	h.decoded[m.ID]++
	h.mu.Unlock()
	return h.handlerFunc.Decode(m)
}

func (h *decodeCounter) calls(id string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.decoded[id]
}

// TestABodyOverMaxBodyBytesIsDeadLetteredUndecoded: a body one byte over
// MaxBodyBytes is dead-lettered as body_too_large without Decode ever seeing
// it, its dead letter carrying the first 64 KiB and the body's length; a body
// of exactly MaxBodyBytes is processed. Oversized bodies are poison, not a
// broken deploy: however many arrive, the kill switch does not trip. Before,
// any body was decoded, and dead-lettered whole.
func TestABodyOverMaxBodyBytesIsDeadLetteredUndecoded(t *testing.T) {
	t.Parallel()
	const limit, letterCap, oversized = 128 << 10, 64 << 10, 3
	h := &decodeCounter{handlerFunc: handlerFunc{apply: func(context.Context, pgx.Tx) error { return nil }}, decoded: map[string]int{}}
	r := startRig[[]byte](t, h, func(cfg *consumer.Config) {
		cfg.MaxBodyBytes = limit
		cfg.KillSwitch = consumer.KillSwitch{Threshold: 2}
	})
	for i := range oversized {
		r.publish(fmt.Sprintf("evt_big_%d", i), strings.Repeat("b", limit+1))
	}
	r.publish("evt_at_limit", strings.Repeat("a", limit))
	for range oversized {
		d := r.deadLetter()
		require.Contains(t, d.MessageId, "evt_big_")
		require.Equal(t, wire.ReasonBodyTooLarge, d.Headers[wire.HeaderReason])
		require.Equal(t, int64(limit+1), d.Headers[wire.HeaderBodyBytes])
		require.Equal(t, strings.Repeat("b", letterCap), string(d.Body), "the dead letter carries the body's first 64 KiB")
		require.Zero(t, h.calls(d.MessageId), "Decode saw an oversized body")
	}
	require.Eventually(t, func() bool { return r.stats[guard.OutcomeProcessed.String()].Load() == 1 },
		30*time.Second, 10*time.Millisecond, "a body of exactly MaxBodyBytes is processed")
	require.Equal(t, 1, h.calls("evt_at_limit"))
	require.Zero(t, r.stats[wire.CounterKillSwitchTrips].Load(), "oversized bodies tripped the kill switch")
	require.Empty(t, r.consumerStats().Tripped)
}
