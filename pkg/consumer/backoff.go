package consumer

import (
	"context"
	"math/rand/v2"
	"time"
)

// Backoff is an exponential backoff with full jitter.
type Backoff struct {
	// Min is the first delay. Must be positive.
	Min time.Duration
	// Max caps the delay. Must be at least Min.
	Max time.Duration
}

// Delay returns the delay before attempt n (n >= 1): a random duration in
// [d/2, d] where d = min(Max, Min·2^(n-1)). The jitter spreads a fleet's
// retries so they do not arrive together.
func (b Backoff) Delay(n int) time.Duration {
	d := b.Min
	for i := 1; i < n && d < b.Max; i++ {
		d *= 2
	}
	d = min(d, b.Max)
	return d/2 + rand.N(d/2+1)
}

// sleep waits d or until ctx ends, and reports whether it waited the whole d.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
