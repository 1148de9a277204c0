package relay_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/layout"
	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/testenv"
)

// TestAQueueDestinationMustSplitItsStreamAsRecorded: a queue destination
// naming another partition count than its stream was set up with routed a
// key's messages to other queues than the stream's publishers, or to ones
// nobody reads; it is refused, naming the destination, both counts and the
// fix. A stream the database records nothing of is not checked.
func TestAQueueDestinationMustSplitItsStreamAsRecorded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, _ := testenv.Schema(t)
	_, err := layout.CheckPartitions(ctx, db, "receipts.events", 4)
	require.NoError(t, err)
	_, err = layout.CheckPartitions(ctx, db, "audit.events", 1)
	require.NoError(t, err)
	cases := []struct {
		dests string
		want  []string // in the error; none: accepted
	}{
		{"receipts=queue:receipts.events/4", nil},
		{"receipts=queue:receipts.events/2", []string{"receipts=queue:receipts.events/2", "set up with 4 partition(s)", "names 2", "receipts=queue:receipts.events/4", "idem repartition"}},
		{"receipts=queue:receipts.events", []string{"set up with 4 partition(s)", "names 1"}},
		{"audit=queue:audit.events", nil},
		{"audit=queue:audit.events/1", nil},
		{"audit=queue:audit.events/3 receipts=queue:receipts.events/4", []string{"audit=queue:audit.events/3", "set up with 1 partition(s)", "names 3"}},
		{"other=queue:never.recorded/8", nil},
		{"x=exchange:receipts.events/k hook=https://example.com/hook", nil},
	}
	for _, c := range cases {
		dests, err := relay.ParseDestinations(c.dests)
		require.NoError(t, err)
		err = relay.CheckPartitions(ctx, db, dests)
		if c.want == nil {
			require.NoError(t, err, c.dests)
			continue
		}
		require.ErrorIs(t, err, relay.ErrDestinationPartitions, c.dests)
		for _, w := range c.want {
			require.ErrorContains(t, err, w, c.dests)
		}
	}
	// A database the migrations have not reached records nothing.
	empty, _ := testenv.EmptySchema(t)
	dests, err := relay.ParseDestinations("receipts=queue:receipts.events/2")
	require.NoError(t, err)
	require.NoError(t, relay.CheckPartitions(ctx, empty, dests))
}
