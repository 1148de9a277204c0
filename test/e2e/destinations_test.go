package e2e

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/layout"
)

// TestARelayRefusesAQueueDestinationSplitOtherwise: idem relay, and idem
// consume with outbox.relay, refuse at start a queue destination whose
// partition count differs from the one recorded for its stream, saying
// which, both counts and the fix.
func TestARelayRefusesAQueueDestinationSplitOtherwise(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	stream := e.queue + ".receipts"
	_, err := layout.CheckPartitions(context.Background(), e.pool, stream, 4)
	require.NoError(t, err)
	dests := "IDEM_OUTBOX_DESTINATIONS=receipts=queue:" + stream + "/2"
	for _, args := range [][]string{{"relay"}, {"consume", "--no-migrate"}} {
		r := e.run([]string{dests, "IDEM_OUTBOX_RELAY=true"}, args...)
		require.Equal(t, 1, r.code, r.out)
		for _, want := range []string{"receipts=queue:" + stream + "/2", "set up with 4 partition(s)", "names 2", "receipts=queue:" + stream + "/4", "idem repartition"} {
			require.Contains(t, r.out, want, args)
		}
	}
}
