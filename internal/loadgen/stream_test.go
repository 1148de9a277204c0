package loadgen

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestBuildIsReproducibleAndCountsDuplicates(t *testing.T) {
	spec := StreamSpec{RunID: "r", Count: 1000, Users: 10, DupRatio: 0.25, DelayWindow: 50, Seed: 42}
	a, err := Build(spec)
	require.NoError(t, err)
	b, err := Build(spec)
	require.NoError(t, err)
	require.Equal(t, a, b, "same spec and seed must give the same stream")
	require.Len(t, a.Order, 1250)
	require.Equal(t, 250, a.BackToBack+a.Delayed)
	require.Equal(t, 125, a.BackToBack)

	seen := map[int]int{}
	backToBack := 0
	for i, idx := range a.Order {
		seen[idx]++
		if seen[idx] > 1 && i > 0 && a.Order[i-1] == idx {
			backToBack++
		}
		if seen[idx] == 1 {
			// A re-send never precedes its original.
			for _, later := range a.Order[:i] {
				require.NotEqual(t, idx, later)
			}
		}
	}
	require.Len(t, seen, 1000, "every event is sent at least once")
	require.GreaterOrEqual(t, backToBack, 100)

	m := NewManifest(spec, "q", a)
	total := 0
	for _, ev := range m.Events {
		total += ev.Sends
	}
	require.Equal(t, len(a.Order), total)
}

func TestBuildRejectsBadSpecs(t *testing.T) {
	for _, spec := range []StreamSpec{{Count: 0, Users: 1}, {Count: 1, Users: 0}, {Count: 1, Users: 1, DupRatio: -1}} {
		_, err := Build(spec)
		require.Error(t, err)
	}
}
