package broker

import (
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestTopologyNamesFollowTheQueue(t *testing.T) {
	top := TopologyFor("payments.events", 20)
	require.Equal(t, "payments.events.dlx", top.DeadLetterExchange)
	require.Equal(t, "payments.events.dlq", top.DeadLetterQueue)
}

// TestStraysReachBeyondThePartitionCount: besides the layouts the stream
// had, the strays are the partition queues a publisher with a larger count
// would send to: from the count up to max(2n, n+8), below
// MaxStrayPartition.
func TestStraysReachBeyondThePartitionCount(t *testing.T) {
	parts := func(from, to int) []string {
		var out []string
		for p := from; p < to; p++ {
			out = append(out, "q."+strconv.Itoa(p))
		}
		return out
	}
	cases := []struct {
		name       string
		partitions int
		former     int
		want       []string
	}{
		{"one queue", 0, 0, parts(0, 9)},
		{"two", 2, 0, append([]string{"q"}, parts(2, 10)...)},
		{"two, formerly four", 2, 4, append([]string{"q"}, parts(2, 10)...)},
		{"two, formerly twelve", 2, 12, append([]string{"q"}, parts(2, 12)...)},
		{"sixteen", 16, 0, append([]string{"q"}, parts(16, 32)...)},
		{"near the cap", 1000, 0, append([]string{"q"}, parts(1000, MaxStrayPartition)...)},
		{"at the cap", MaxStrayPartition, 0, []string{"q"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			top := TopologyFor("q", 0)
			top.Partitions = c.partitions
			require.ElementsMatch(t, c.want, top.Strays(c.former))
		})
	}
}
