package layout_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/layout"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/guard/pgtier"
)

// TestTheGuardsCallsAreCheckedAtStart: on a migrated database the calls a
// claim makes pass; a history the role cannot read is said at start,
// naming the functions; a partitioned idem_processed, whose file node the
// history cannot read, is refused.
func TestTheGuardsCallsAreCheckedAtStart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := testenv.Schema(t)
	require.NoError(t, layout.CheckGuardCalls(ctx, pool, pgtier.New(pool).History))

	denied := func(context.Context) (tier.History, error) {
		return "", errors.New("ERROR: permission denied for function pg_control_system (SQLSTATE 42501)")
	}
	err := layout.CheckGuardCalls(ctx, pool, denied)
	require.ErrorContains(t, err, "the guard cannot read the database's history (pg_control_system")

	_, err = pool.Exec(ctx, `DROP TABLE idem_processed CASCADE;
		CREATE TABLE idem_processed (scope text NOT NULL, event_id text NOT NULL, PRIMARY KEY (scope, event_id)) PARTITION BY HASH (scope)`)
	require.NoError(t, err)
	require.ErrorIs(t, layout.CheckGuardCalls(ctx, pool, pgtier.New(pool).History), layout.ErrPartitionedDedupTable)
}
