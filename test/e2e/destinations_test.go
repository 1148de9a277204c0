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

// TestARelayRefusesPendingRowsToAnUnknownDestination: idem relay, and idem
// consume with outbox.relay, refuse to start (exit 2, a setting to fix)
// while pending outbox rows name a destination outbox.destinations does not,
// naming each with its count and the fix; a relay would have made each dead
// at once. The rows stay pending. Dead rows do not count.
func TestARelayRefusesPendingRowsToAnUnknownDestination(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	_, err := e.pool.Exec(context.Background(), `INSERT INTO idem_outbox (scope, event_id, idx, destination, lane, body, state) VALUES
		('pay', 'e1', 0, 'sms', 1, '', 'pending'),
		('pay', 'e2', 0, 'sms', 2, '', 'pending'),
		('pay', 'e3', 0, 'fax', 3, '', 'pending'),
		('pay', 'e4', 0, 'receipts', 4, '', 'pending'),
		('pay', 'e5', 0, 'telex', 5, '', 'dead')`)
	require.NoError(t, err)
	dests := "IDEM_OUTBOX_DESTINATIONS=receipts=queue:" + e.queue + ".receipts"
	for _, args := range [][]string{{"relay"}, {"consume", "--no-migrate"}} {
		r := e.run([]string{dests, "IDEM_OUTBOX_RELAY=true"}, args...)
		require.Equal(t, 2, r.code, r.out)
		for _, want := range []string{`outbox.destinations does not name the destination of pending outbox rows: "fax" (1 row(s)), "sms" (2 row(s))`,
			"they stay pending", "add each to outbox.destinations"} {
			require.Contains(t, r.out, want, args)
		}
		require.NotContains(t, r.out, "telex", args)
		require.NotContains(t, r.out, `"receipts"`, args)
	}
	require.Equal(t, map[string]int{"pending": 4, "dead": 1}, e.outboxStates(), "nothing was made dead")
}
