package relay_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/testenv"
)

// TestPendingDestinationsCountsTheOldestPendingRows: pending rows only, by
// destination, the oldest limit of them, saying whether that was all; a
// database not migrated yet has none.
func TestPendingDestinationsCountsTheOldestPendingRows(t *testing.T) {
	ctx := context.Background()
	empty, _ := testenv.EmptySchema(t)
	got, all, err := relay.PendingDestinations(ctx, empty, 10)
	require.NoError(t, err)
	require.Empty(t, got)
	require.True(t, all)

	db, _ := testenv.Schema(t)
	_, err = db.Exec(ctx, `INSERT INTO idem_outbox (scope, event_id, idx, destination, lane, body, state) VALUES
		('pay', 'e1', 0, 'sms', 1, '', 'pending'),
		('pay', 'e2', 0, 'api', 2, '', 'pending'),
		('pay', 'e3', 0, 'sms', 3, '', 'pending'),
		('pay', 'e4', 0, 'fax', 4, '', 'dead'),
		('pay', 'e5', 0, 'fax', 5, '', 'sent')`)
	require.NoError(t, err)
	got, all, err = relay.PendingDestinations(ctx, db, 10)
	require.NoError(t, err)
	require.Equal(t, map[string]int{"sms": 2, "api": 1}, got)
	require.True(t, all)
	got, all, err = relay.PendingDestinations(ctx, db, 2)
	require.NoError(t, err)
	require.Equal(t, map[string]int{"sms": 1, "api": 1}, got, "the oldest two")
	require.False(t, all)
}
