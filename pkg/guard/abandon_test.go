package guard_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/guard"
)

// TestAbandonReleasesTheBatchsLeases: a screened batch whose events go back
// to the queue instead of to Decide leaves no lease behind, so that they
// are claimed at once when they come back.
func TestAbandonReleasesTheBatchsLeases(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := context.Background()
	evs := []guard.Event{event("evt_1", 1), event("evt_2", 1)}
	b, err := f.guard.Screen(ctx, evs)
	require.NoError(t, err)
	f.guard.Abandon(ctx, b)
	for _, r := range f.fast.Claim(ctx, "payments", "", evs) {
		require.Equal(t, tier.FastAcquired, r.State, "a lease of the abandoned batch was left behind")
	}
	require.Zero(t, f.ledgerRows(t, "evt_1"))
}
