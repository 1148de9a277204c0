package consumer

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// broker models what RabbitMQ checks of one channel's acks: a tag may be
// settled once, and a multiple-ack settles every unsettled tag at or below
// it. It records the settlements the consumer never meant to make.
type fakeBroker struct {
	mu        sync.Mutex
	unacked   map[uint64]bool
	intended  map[uint64]bool // tags the consumer has settled
	frames    int
	violation error
}

func newBroker(n int) *fakeBroker {
	b := &fakeBroker{unacked: map[uint64]bool{}, intended: map[uint64]bool{}}
	for t := uint64(1); t <= uint64(n); t++ {
		b.unacked[t] = true
	}
	return b
}

func (b *fakeBroker) settle(tag uint64, multiple bool) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.frames++
	if !b.unacked[tag] {
		b.violation = fmt.Errorf("tag %d settled twice (PRECONDITION_FAILED: unknown delivery tag)", tag)
		return b.violation
	}
	for t := range b.unacked {
		if t == tag || multiple && t < tag {
			if !b.intended[t] {
				b.violation = fmt.Errorf("multiple-ack %d covered tag %d, which was not settled", tag, t)
			}
			delete(b.unacked, t)
		}
	}
	return nil
}

func (b *fakeBroker) Ack(tag uint64, multiple bool) error     { return b.settle(tag, multiple) }
func (b *fakeBroker) Nack(tag uint64, multiple, _ bool) error { return b.settle(tag, multiple) }
func (b *fakeBroker) Reject(tag uint64, _ bool) error         { return b.settle(tag, false) }
func (b *fakeBroker) intend(tags ...uint64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, t := range tags {
		b.intended[t] = true
	}
}

func TestAckerUsesMultipleAckOnlyBelowTheFirstUnsettled(t *testing.T) {
	b := newBroker(7)
	a := newAcker(b, 1<<20)
	for tag := uint64(1); tag <= 7; tag++ {
		a.register(tag)
	}
	b.intend(2, 3)
	require.NoError(t, a.ack([]uint64{2, 3}))
	require.Equal(t, 0, b.frames, "1 is unsettled: 2 and 3 wait for it")
	b.intend(1)
	require.NoError(t, a.ack([]uint64{1}))
	require.Equal(t, 1, b.frames, "1 to 3 go as one multiple-ack")
	b.intend(4)
	require.NoError(t, a.nack(4))
	require.Equal(t, 2, b.frames)
	b.intend(5, 6)
	require.NoError(t, a.ack([]uint64{6, 5}))
	require.Equal(t, 3, b.frames, "5 and 6 go as one multiple-ack")
	require.NoError(t, b.violation)
	require.Equal(t, map[uint64]bool{7: true}, b.unacked)
}

// TestAckerSendsAHeldAckWithinTheHold: an ack held behind a delivery that
// stays in progress goes on its own after ackHold, not never.
func TestAckerSendsAHeldAckWithinTheHold(t *testing.T) {
	b := newBroker(2)
	a := newAcker(b, 1<<20)
	a.register(1)
	a.register(2)
	b.intend(2)
	require.NoError(t, a.ack([]uint64{2}))
	require.Eventually(t, func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		return !b.unacked[2]
	}, 10*ackHold, ackHold/4)
	require.True(t, b.unacked[1], "1 is still in progress")
	require.NoError(t, b.violation)
}

// TestAckerHoldsBehindAGapAndSendsAtTheBound: acks behind a delivery still
// in progress wait for it and go as one multiple-ack when it settles (a
// gap of one event set aside for the next batch costs one frame, not one
// per delivery above it); once maxHeld wait, they all go at once.
func TestAckerHoldsBehindAGapAndSendsAtTheBound(t *testing.T) {
	b := newBroker(12)
	a := newAcker(b, 4)
	for tag := uint64(1); tag <= 12; tag++ {
		a.register(tag)
	}
	// settle acks tags and checks the frames sent so far.
	settle := func(frames int, why string, tags ...uint64) {
		t.Helper()
		b.intend(tags...)
		require.NoError(t, a.ack(tags))
		require.Equal(t, frames, b.frames, why)
	}
	settle(0, "held behind 1", 2, 3, 4)
	settle(1, "1 to 4 in one multiple-ack", 1)
	settle(1, "three held behind 5, below the bound", 6, 7, 8)
	settle(5, "the fourth held: all four go at once, one by one", 9)
	_, held := a.counts()
	require.Zero(t, held)
	b.mu.Lock()
	require.True(t, b.unacked[5], "5 is still in progress")
	b.mu.Unlock()
	settle(6, "5 and 10 in one multiple-ack over the acked 6 to 9", 5, 10)
	require.NoError(t, b.violation)
}

// TestAckerNeverSettlesWhatWasNotSettled settles a stream of deliveries from
// many goroutines at once, in random groups and order, with some nacks, and
// checks against a model of the broker that no tag is settled twice and no
// multiple-ack covers a delivery still being processed.
func TestAckerNeverSettlesWhatWasNotSettled(t *testing.T) {
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 1))
		const n = 2000
		b := newBroker(n)
		a := newAcker(b, 1<<20)
		work := make(chan []uint64)
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() {
				for tags := range work {
					if len(tags) == 1 && tags[0]%7 == 0 {
						b.intend(tags[0])
						require.NoError(t, a.nack(tags[0]))
						continue
					}
					b.intend(tags...)
					require.NoError(t, a.ack(tags))
				}
			})
		}
		for tag := uint64(1); tag <= n; {
			size := 1 + rng.IntN(16)
			var group []uint64
			for ; size > 0 && tag <= n; size-- {
				a.register(tag)
				group = append(group, tag)
				tag++
			}
			rng.Shuffle(len(group), func(i, j int) { group[i], group[j] = group[j], group[i] })
			work <- group
		}
		close(work)
		wg.Wait()
		a.flush()
		require.NoError(t, b.violation, "seed %d", seed)
		require.Empty(t, b.unacked, "seed %d: every delivery settled", seed)
		require.Less(t, b.frames, n, "seed %d: multiple-acks saved frames", seed)
	}
}

// TestAckerWaitsForTagsNotRegisteredYet: with several queues consumed on one
// channel, a delivery of one queue can reach the acker before a lower tag of
// another queue's. A multiple-ack must not cover the tag still on its way.
func TestAckerWaitsForTagsNotRegisteredYet(t *testing.T) {
	b := newBroker(4)
	a := newAcker(b, 1<<20)
	a.register(2)
	a.register(3)
	b.intend(2, 3)
	require.NoError(t, a.ack([]uint64{2, 3}))
	require.Equal(t, 0, b.frames, "tag 1 was never registered: 2 and 3 wait")
	a.register(1)
	a.register(4)
	b.intend(1)
	require.NoError(t, a.ack([]uint64{1}))
	require.Equal(t, 1, b.frames, "1 to 3 go as one multiple-ack")
	require.NoError(t, b.violation)
	require.Equal(t, map[uint64]bool{4: true}, b.unacked)
}
