package cli

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/fastkey"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/guard/pgtier"
)

// TestInspectSaysWhetherAMarkersHistoryIsTheDatabases: a done marker of
// the database's history now is trusted; one of another history (the
// database failed over or was restored since) is said to count as absent,
// as the guard treats it.
func TestInspectSaysWhetherAMarkersHistoryIsTheDatabases(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t)
	ctx := context.Background()
	now, err := pgtier.New(pool).History(ctx)
	require.NoError(t, err)
	dbs := Shards{pool}

	require.Equal(t, string(now)+", the database's now: trusted",
		markerHistory(ctx, fastkey.Marker{State: tier.FastDone, History: now}, dbs, nil))
	require.Equal(t, string(now)+", shard 0's now: trusted by a consumer whose event maps to shard 0",
		markerHistory(ctx, fastkey.Marker{State: tier.FastDone, History: now}, Shards{pool, pool}, nil))
	other := markerHistory(ctx, fastkey.Marker{State: tier.FastDone, History: "0123456789ab"}, dbs, nil)
	require.Contains(t, other, "0123456789ab, not the database's now ("+string(now)+")")
	require.Contains(t, other, "the marker counts as absent and the next copy goes to PostgreSQL")
	require.Contains(t, markerHistory(ctx, fastkey.Marker{State: tier.FastDone}, dbs, nil), "counts as absent")
	require.Contains(t, markerHistory(ctx, fastkey.Marker{State: tier.FastPending, History: "0123456789ab"}, dbs, nil),
		"a lease holds whatever its history until it expires")
}
