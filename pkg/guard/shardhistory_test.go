package guard

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/tier"
)

// gatedStore answers History with the next of its answers, each once the
// test lets it go; it has no rows.
type gatedStore struct {
	answers chan tier.History
	mu      sync.Mutex
	calls   int
}

func (s *gatedStore) History(ctx context.Context) (tier.History, error) {
	s.mu.Lock()
	s.calls++
	s.mu.Unlock()
	select {
	case h := <-s.answers:
		return h, nil
	case <-ctx.Done():
		return "", ctx.Err()
	}
}

func (s *gatedStore) Begin(context.Context) (pgx.Tx, error) { panic("no rows") }
func (s *gatedStore) Claim(context.Context, pgx.Tx, string, []Event) ([]tier.ClaimResult, tier.History, error) {
	panic("no rows")
}

func (s *gatedStore) called() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls
}

// TestAHistoryReadIsSharedOnlyByThoseWhoCameBeforeIt: callers that arrive
// while a read is in flight do not take its answer (it may have been sent
// before they read their markers); they share the next read, one for all
// of them.
func TestAHistoryReadIsSharedOnlyByThoseWhoCameBeforeIt(t *testing.T) {
	s := &gatedStore{answers: make(chan tier.History)}
	sh := newShardHistories(1)[0]
	ctx := context.Background()

	read := func(into chan<- tier.History) {
		h, err := sh.read(ctx, s)
		if err != nil {
			h = tier.History("error: " + err.Error())
		}
		into <- h
	}
	first := make(chan tier.History, 1)
	go read(first)
	require.Eventually(t, func() bool { return s.called() == 1 }, 5*time.Second, time.Millisecond)

	later := make(chan tier.History, 8)
	for range 8 {
		go read(later)
	}
	require.Eventually(t, func() bool {
		sh.mu.Lock()
		defer sh.mu.Unlock()
		return sh.next != nil && sh.next.callers == 8
	}, 5*time.Second, time.Millisecond, "the eight never joined the next read")
	s.answers <- "before"
	require.Equal(t, tier.History("before"), <-first)
	s.answers <- "after"
	for range 8 {
		require.Equal(t, tier.History("after"), <-later, "a caller took the answer of a read sent before it came")
	}
	require.Equal(t, 2, s.called(), "the eight shared one read")
}
