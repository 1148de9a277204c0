package relay

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestARoundOfNothingRightAfterRowsWaitsBriefly: a relay's passes share one
// count of empty passes; a whole round of them makes the loops wait, for
// the poll interval, or for busyPoll if a pass found rows within it (their
// lanes may only have been held by another relay's passes).
func TestARoundOfNothingRightAfterRowsWaitsBriefly(t *testing.T) {
	const passes, poll = 4, time.Second
	var i idleRounds

	// Idle from the start: three empty passes, then the fourth ends the
	// round; a pass of the other loop that started before it ended waits
	// too, without counting.
	other := i.started()
	for range passes - 1 {
		_, idle := i.ended(i.started(), false, passes, poll)
		require.False(t, idle)
	}
	until, idle := i.ended(i.started(), false, passes, poll)
	require.True(t, idle)
	require.WithinDuration(t, time.Now().Add(poll), until, 100*time.Millisecond)
	same, idle := i.ended(other, false, passes, poll)
	require.True(t, idle, "the round ended while this pass ran")
	require.Equal(t, until, same, "the loops look again together")

	// A pass that found rows starts the count again, and the next round
	// of nothing waits only busyPoll.
	_, idle = i.ended(i.started(), true, passes, poll)
	require.False(t, idle)
	for range passes - 1 {
		_, idle := i.ended(i.started(), false, passes, poll)
		require.False(t, idle, "a round takes %d empty passes", passes)
	}
	until, idle = i.ended(i.started(), false, passes, poll)
	require.True(t, idle)
	require.WithinDuration(t, time.Now().Add(busyPoll), until, 20*time.Millisecond)

	// Once the rows were found longer ago than the poll interval, a round
	// of nothing waits the whole interval again.
	i.found = time.Now().Add(-2 * poll)
	for range passes - 1 {
		i.ended(i.started(), false, passes, poll)
	}
	until, idle = i.ended(i.started(), false, passes, poll)
	require.True(t, idle)
	require.WithinDuration(t, time.Now().Add(poll), until, 100*time.Millisecond)
}

// TestALoopWakingBeforeTheOthersRoundEndedWaitsForItsPoll: a loop whose
// wait ends while the other's later round of nothing set a later poll
// waits on for that one, so that the two start their next round together.
func TestALoopWakingBeforeTheOthersRoundEndedWaitsForItsPoll(t *testing.T) {
	var i idleRounds
	first := time.Now().Add(20 * time.Millisecond)
	i.next = time.Now().Add(150 * time.Millisecond) // the other loop's, later
	start := time.Now()
	i.wait(context.Background(), nil, first)
	require.GreaterOrEqual(t, time.Since(start), 140*time.Millisecond)

	wake := make(chan struct{}, 1)
	wake <- struct{}{}
	i.next = time.Now().Add(time.Hour)
	start = time.Now()
	i.wait(context.Background(), wake, time.Now().Add(time.Hour))
	require.Less(t, time.Since(start), time.Second, "a notification ends the wait")
}
