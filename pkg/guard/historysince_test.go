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

// doneFast is a fast tier that knows every event as done in history h,
// with the event's own hash.
type doneFast struct{ h tier.History }

func (f doneFast) Claim(_ context.Context, _ string, _ tier.History, events []Event) []tier.FastResult {
	out := make([]tier.FastResult, len(events))
	for i, ev := range events {
		out[i] = tier.FastResult{State: tier.FastDone, Hash: ev.Hash, History: f.h}
	}
	return out
}
func (doneFast) MarkDone(context.Context, string, tier.History, []Event) error { return nil }
func (doneFast) Release(context.Context, string, []tier.Lease) error           { return nil }

// TestAReadAnsweredBeforeTheScreenConfirmsNoMarker: a delivery that waited
// for a worker while the database failed over (history H to H2) is
// screened after the change. A read another duplicate sent after the
// delivery arrived, but answered before the change, must not confirm its
// marker: only a statement sent after its screen does, and that one
// answers H2. (A review found a build that dated a batch from the
// consumer's receipt of its deliveries, which took read 1's H.)
func TestAReadAnsweredBeforeTheScreenConfirmsNoMarker(t *testing.T) {
	s := &gatedStore{answers: make(chan tier.History, 4)}
	g, err := New(Config{Scope: "payments", Store: s, Fast: doneFast{h: "H"}})
	require.NoError(t, err)
	ctx := context.Background()

	s.answers <- "H" // read 1, for another duplicate
	b0, err := g.Screen(ctx, []Event{{ID: "evt_other", Hash: HashFields("evt_other")}})
	require.NoError(t, err)
	require.NoError(t, g.Confirm(ctx, b0))
	require.Equal(t, OutcomeDuplicateRedis, b0.res[0].Outcome)
	require.Equal(t, 1, s.called())

	s.answers <- "H2" // the failover: read 2 answers the new history
	b, err := g.Screen(ctx, []Event{{ID: "evt_x", Hash: HashFields("evt_x")}})
	require.NoError(t, err)
	require.NoError(t, g.Confirm(ctx, b))
	require.Equal(t, 2, s.called(), "the delivery screened after read 1 answered took it")
	require.NotEqual(t, OutcomeDuplicateRedis, b.res[0].Outcome, "a marker of H was trusted on a read answered before the screen")
}
