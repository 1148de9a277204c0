package relay

import (
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
	wait, idle := i.ended(i.started(), false, passes, poll)
	require.True(t, idle)
	require.Equal(t, poll, wait)
	wait, idle = i.ended(other, false, passes, poll)
	require.True(t, idle, "the round ended while this pass ran")
	require.Equal(t, poll, wait)

	// A pass that found rows starts the count again, and the next round
	// of nothing waits only busyPoll.
	_, idle = i.ended(i.started(), true, passes, poll)
	require.False(t, idle)
	for range passes - 1 {
		_, idle := i.ended(i.started(), false, passes, poll)
		require.False(t, idle, "a round takes %d empty passes", passes)
	}
	wait, idle = i.ended(i.started(), false, passes, poll)
	require.True(t, idle)
	require.Equal(t, busyPoll, wait)

	// Once the rows were found longer ago than the poll interval, a round
	// of nothing waits the whole interval again.
	i.found = time.Now().Add(-2 * poll)
	for range passes - 1 {
		i.ended(i.started(), false, passes, poll)
	}
	wait, idle = i.ended(i.started(), false, passes, poll)
	require.True(t, idle)
	require.Equal(t, poll, wait)
}
