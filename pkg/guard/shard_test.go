package guard_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/partition"
)

// keyOn returns a shard key that maps to shard s of n.
func keyOn(s, n int) string {
	for i := 0; ; i++ {
		if k := fmt.Sprintf("user_%d", i); partition.Of(k, n) == s {
			return k
		}
	}
}

func sharded(id, key string) guard.Event {
	return guard.Event{ID: id, Hash: guard.HashFields(id, key), ShardKey: key}
}

func rows(t *testing.T, pool *pgxpool.Pool, id string) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM idem_processed WHERE event_id = $1`, id).Scan(&n))
	return n
}

// TestShardsKeepEachDedupRowWithItsKey runs a guard over two schemas
// standing in for two databases: each batch's rows land on the shard of its
// key, a batch may not span shards, and a duplicate is caught on its shard.
func TestShardsKeepEachDedupRowWithItsKey(t *testing.T) {
	t.Parallel()
	p0, _ := testenv.Schema(t)
	p1, _ := testenv.Schema(t)
	g, err := guard.New(guard.Config{Scope: "payments", Shards: []guard.Store{pgtier.New(p0), pgtier.New(p1)}})
	require.NoError(t, err)
	require.Equal(t, 2, g.Shards())
	ctx := context.Background()
	k0, k1 := keyOn(0, 2), keyOn(1, 2)

	on0 := []guard.Event{sharded("evt_a", k0), sharded("evt_b", k0)}
	res, err := g.ProcessBatch(ctx, on0, payAll(on0))
	require.NoError(t, err)
	require.Equal(t, []guard.Outcome{guard.OutcomeProcessed, guard.OutcomeProcessed}, outcomes(res))
	on1 := []guard.Event{sharded("evt_c", k1)}
	res, err = g.ProcessBatch(ctx, on1, payAll(on1))
	require.NoError(t, err)
	require.Equal(t, guard.OutcomeProcessed, res[0].Outcome)
	require.Equal(t, []int{1, 1, 0}, []int{rows(t, p0, "evt_a"), rows(t, p0, "evt_b"), rows(t, p0, "evt_c")})
	require.Equal(t, []int{0, 0, 1}, []int{rows(t, p1, "evt_a"), rows(t, p1, "evt_b"), rows(t, p1, "evt_c")})

	out, err := g.Process(ctx, sharded("evt_a", k0), pay("evt_a"))
	require.NoError(t, err)
	require.Equal(t, guard.OutcomeDuplicatePostgres, out)

	mixed := []guard.Event{sharded("evt_d", k0), sharded("evt_e", k1)}
	_, err = g.ProcessBatch(ctx, mixed, payAll(mixed))
	require.ErrorIs(t, err, guard.ErrMixedShards)
	require.Zero(t, rows(t, p0, "evt_d")+rows(t, p1, "evt_e"), "a refused batch commits nothing")

	// The cost of sharding: the same ID under another key is on another
	// shard, where its first payload cannot be seen.
	out, err = g.Process(ctx, sharded("evt_a", k1), pay("evt_a"))
	require.NoError(t, err)
	require.Equal(t, guard.OutcomeProcessed, out)
}

func TestShardsOrStoreNotBoth(t *testing.T) {
	p, _ := testenv.Schema(t)
	_, err := guard.New(guard.Config{Scope: "s", Store: pgtier.New(p), Shards: []guard.Store{pgtier.New(p)}})
	require.ErrorContains(t, err, "not both")
	_, err = guard.New(guard.Config{Scope: "s", Shards: []guard.Store{pgtier.New(p), nil}})
	require.ErrorContains(t, err, "nil Store")
}
