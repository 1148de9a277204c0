package pgtier_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
)

// TestHistoryIsTheClaimsAndChangesWithTheTable: every connection, and every
// claim, reports one history for one dedup table; a table truncated (as a
// restore of it would put its rows back) is a new history, and so is
// another table (another schema, here; another database or cluster
// likewise).
func TestHistoryIsTheClaimsAndChangesWithTheTable(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t, testenv.Effects)
	s := pgtier.New(pool)
	ctx := context.Background()
	h, err := s.History(ctx)
	require.NoError(t, err)
	require.Regexp(t, `^[0-9a-f]{12}$`, string(h))

	// Two connections at once: the pool cannot hand the same one twice.
	c1, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer c1.Release() // a second Release does nothing
	c2, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer c2.Release()
	var h1, h2 string
	require.NoError(t, c1.QueryRow(ctx, pgtier.HistoryQuery).Scan(&h1))
	require.NoError(t, c2.QueryRow(ctx, pgtier.HistoryQuery).Scan(&h2))
	require.Equal(t, string(h), h1)
	require.Equal(t, h1, h2)

	tx, err := s.Begin(ctx)
	require.NoError(t, err)
	_, claimed, err := s.Claim(ctx, tx, "svc", []guard.Event{ev("e", "a")})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, h, claimed, "the claim reads the same history")

	c1.Release()
	c2.Release()
	_, err = pool.Exec(ctx, `TRUNCATE idem_processed`)
	require.NoError(t, err)
	after, err := s.History(ctx)
	require.NoError(t, err)
	require.NotEqual(t, h, after, "a truncated table is a new history")

	other, _ := testenv.Schema(t, testenv.Effects)
	oh, err := pgtier.New(other).History(ctx)
	require.NoError(t, err)
	require.NotEqual(t, after, oh, "another table is another history")
	require.NotEqual(t, tier.History(""), oh)
}
