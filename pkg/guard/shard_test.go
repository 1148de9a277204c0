package guard_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/guard/redistier"
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
	p0, _ := testenv.Schema(t, testenv.Effects)
	p1, _ := testenv.Schema(t, testenv.Effects)
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
	p, _ := testenv.Schema(t, testenv.Effects)
	_, err := guard.New(guard.Config{Scope: "s", Store: pgtier.New(p), Shards: []guard.Store{pgtier.New(p)}})
	require.ErrorContains(t, err, "not both")
	_, err = guard.New(guard.Config{Scope: "s", Shards: []guard.Store{pgtier.New(p), nil}})
	require.ErrorContains(t, err, "nil Store")
}

// conflictCounter is a guard.Observer that counts cross-shard conflicts.
type conflictCounter struct {
	mu  sync.Mutex
	ids []string
}

func (*conflictCounter) ObserveStage(context.Context, guard.Stage, int, time.Duration, error) {}
func (c *conflictCounter) CrossShardConflict(_ context.Context, ev guard.Event) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.ids = append(c.ids, ev.ID)
}

// TestCrossShardConflictsRedisRemembersAreCounted: the same ID under keys of
// two shards, with two payloads, is processed on both (no shard can see the
// other's row), but the fast tier's done marker betrays it and it is
// counted. On one shard the same pair is a payload conflict, not counted.
func TestCrossShardConflictsRedisRemembersAreCounted(t *testing.T) {
	t.Parallel()
	p0, _ := testenv.Schema(t, testenv.Effects)
	p1, _ := testenv.Schema(t, testenv.Effects)
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr(), ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { rdb.Close() })
	fast, err := redistier.New(rdb, redistier.Config{Timeout: time.Second})
	require.NoError(t, err)
	obs := &conflictCounter{}
	g, err := guard.New(guard.Config{Scope: "payments", Shards: []guard.Store{pgtier.New(p0), pgtier.New(p1)}, Fast: fast, Observer: obs})
	require.NoError(t, err)
	ctx := context.Background()
	k0, k1, k0b := keyOn(0, 2), keyOn(1, 2), keyOn(0, 2)+"_"
	for partition.Of(k0b, 2) != 0 {
		k0b += "_"
	}

	out, err := g.Process(ctx, sharded("evt_x", k0), pay("evt_x"))
	require.NoError(t, err)
	require.Equal(t, guard.OutcomeProcessed, out)
	require.NoError(t, g.Flush(ctx))
	out, err = g.Process(ctx, sharded("evt_x", k1), pay("evt_x"))
	require.NoError(t, err)
	require.Equal(t, guard.OutcomeProcessed, out, "shard 1 cannot see shard 0's row")
	require.Equal(t, []string{"evt_x"}, obs.ids)

	out, err = g.Process(ctx, sharded("evt_x", k0b), pay("evt_x"))
	require.ErrorIs(t, err, guard.ErrPayloadConflict, "on one shard the conflict is seen")
	require.Equal(t, guard.OutcomePayloadConflict, out)
	require.Len(t, obs.ids, 1, "a conflict the store saw is not a cross-shard one")
}
