package guard

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/tier"
)

// TestAHistoryCountsOnlyFromAStatementSentAfterTheScreen: since(t) never
// takes the answer of a statement (a claim, observed, or a read) sent at
// or before t; a claim sent after every caller of the next read answers
// them all, and no read is sent; a caller screened after that claim was
// sent reads again.
func TestAHistoryCountsOnlyFromAStatementSentAfterTheScreen(t *testing.T) {
	s := &gatedStore{answers: make(chan tier.History, 4)}
	sh := newShardHistories(1)[0]
	ctx := context.Background()
	since := func(at time.Time) <-chan tier.History {
		out := make(chan tier.History, 1)
		go func() {
			h, err := sh.since(ctx, s, at)
			if err != nil {
				h = tier.History("error: " + err.Error())
			}
			out <- h
		}()
		return out
	}

	// A claim sent before the screen does not count: a read is sent.
	before := time.Now()
	time.Sleep(time.Millisecond)
	screened := time.Now()
	sh.observe(before, "claim-before")
	s.answers <- "read-1"
	require.Equal(t, tier.History("read-1"), <-since(screened))
	require.Equal(t, 1, s.called())

	// A read is in flight (its turn taken); A and B join the next read.
	sh.turn <- struct{}{}
	tA := time.Now()
	a := since(tA)
	tB := time.Now()
	b := since(tB)
	require.Eventually(t, func() bool {
		sh.mu.Lock()
		defer sh.mu.Unlock()
		return sh.next != nil && sh.next.callers == 2
	}, 5*time.Second, time.Millisecond)
	// A claim sent between A's and B's screens answers neither.
	sh.observe(tA.Add((tB.Sub(tA))/2), "claim-between")
	select {
	case h := <-a:
		t.Fatalf("A took %q, from a claim sent before B (who shares its read) was screened", h)
	case <-time.After(20 * time.Millisecond):
	}
	// One sent after both answers both, and the read is not sent.
	claimSent := time.Now()
	sh.observe(claimSent, "claim-after")
	require.Equal(t, tier.History("claim-after"), <-b)
	// A opened the read: it learns of the answer once it has the turn
	// (the read in flight ended).
	<-sh.turn
	require.Equal(t, tier.History("claim-after"), <-a)
	require.Equal(t, 1, s.called(), "the read the claim answered was sent all the same")
	// A caller screened after that claim was sent does not take it.
	time.Sleep(time.Millisecond)
	s.answers <- "read-2"
	require.Equal(t, tier.History("read-2"), <-since(time.Now()))
	require.Equal(t, 2, s.called())
	// A caller screened before the latest answer takes it, with no read.
	require.Equal(t, tier.History("read-2"), <-since(claimSent))
	require.Equal(t, 2, s.called())
}

// TestEnoughEventsScreenedSendTheReadBeforeTheGap: the next read waits out
// historyGap after the last was sent while fewer than historyEnough events
// were screened with a marker since, and is sent at once when they reach
// it (as they do, whether before or after its callers join); one read
// answers every caller; the count starts again with each read sent.
func TestEnoughEventsScreenedSendTheReadBeforeTheGap(t *testing.T) {
	s := &gatedStore{answers: make(chan tier.History, 2)}
	sh := newShardHistories(1)[0]
	ctx := context.Background()
	sh.lastSent = time.Now().Add(time.Hour) // the gap would not end in this test
	results := make(chan tier.History, 4)
	wait := func() {
		screened := time.Now()
		go func() {
			h, err := sh.since(ctx, s, screened)
			if err != nil {
				h = tier.History("error: " + err.Error())
			}
			results <- h
		}()
	}
	joined := func(n int) {
		require.Eventually(t, func() bool {
			sh.mu.Lock()
			defer sh.mu.Unlock()
			return sh.next != nil && sh.next.callers == n
		}, 5*time.Second, time.Millisecond)
	}
	answered := func(n int, want tier.History) {
		for range n {
			select {
			case h := <-results:
				require.Equal(t, want, h)
			case <-time.After(10 * time.Second):
				t.Fatal("the read waited for the gap with historyEnough events screened")
			}
		}
	}

	sh.screenedMarked(historyEnough - 1)
	wait()
	wait()
	joined(2)
	time.Sleep(20 * time.Millisecond)
	require.Equal(t, 0, s.called(), "a read sent inside the gap with fewer than historyEnough events screened")
	s.answers <- "read-1"
	sh.screenedMarked(1)
	answered(2, "read-1")
	require.Equal(t, 1, s.called())

	// The count started again when read-1 was sent; enough screened before
	// the next caller joins send its read at once.
	sh.mu.Lock()
	sh.lastSent = time.Now().Add(time.Hour)
	sh.mu.Unlock()
	sh.screenedMarked(historyEnough)
	s.answers <- "read-2"
	wait()
	answered(1, "read-2")
	require.Equal(t, 2, s.called())
}
