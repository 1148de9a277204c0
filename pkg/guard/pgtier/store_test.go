package pgtier_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
)

func ev(id, payload string) guard.Event {
	return guard.Event{ID: id, Hash: guard.HashFields(id, payload)}
}

// claim claims e in a new transaction and leaves it open for the caller.
func claim(t *testing.T, s *pgtier.Store, e guard.Event) (pgx.Tx, guard.ClaimResult) {
	t.Helper()
	tx, err := s.Begin(context.Background())
	require.NoError(t, err)
	res, err := s.Claim(context.Background(), tx, "svc", []guard.Event{e})
	require.NoError(t, err)
	return tx, res[0]
}

func claimCommit(t *testing.T, s *pgtier.Store, e guard.Event) guard.ClaimResult {
	t.Helper()
	tx, res := claim(t, s, e)
	require.NoError(t, tx.Commit(context.Background()))
	return res
}

// claimOpen claims e, requires the insert, and leaves the transaction open.
func claimOpen(t *testing.T, s *pgtier.Store, e guard.Event) pgx.Tx {
	t.Helper()
	tx, res := claim(t, s, e)
	require.Equal(t, guard.ClaimInserted, res)
	return tx
}

func TestClaimInsertsThenReportsDuplicateOrConflict(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t)
	s := pgtier.New(pool)
	require.Equal(t, guard.ClaimInserted, claimCommit(t, s, ev("e1", "a")))
	require.Equal(t, guard.ClaimDuplicate, claimCommit(t, s, ev("e1", "a")))
	require.Equal(t, guard.ClaimConflict, claimCommit(t, s, ev("e1", "b")))
	require.Equal(t, guard.ClaimInserted, claimCommit(t, s, ev("e2", "a")))
}

func TestRolledBackClaimLeavesNoTrace(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t)
	s := pgtier.New(pool)
	tx := claimOpen(t, s, ev("e1", "a"))
	require.NoError(t, tx.Rollback(context.Background()))
	require.Equal(t, guard.ClaimInserted, claimCommit(t, s, ev("e1", "a")))
}

// Many transactions claim one event at once and hold their tx open for a
// moment, as a handler would: the unique key lets exactly one commit a row,
// the rest wait on it and then see a duplicate.
func TestConcurrentClaimsExactlyOneWins(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t)
	s := pgtier.New(pool)
	const n = 16
	results := make([]guard.ClaimResult, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			ctx := context.Background()
			<-start
			tx, err := s.Begin(ctx)
			if err != nil {
				t.Error(err)
				return
			}
			defer tx.Rollback(ctx)
			res, err := s.Claim(ctx, tx, "svc", []guard.Event{ev("hot", "a")})
			if err != nil {
				t.Error(err)
				return
			}
			results[i] = res[0]
			if res[0] == guard.ClaimInserted {
				// The effect would run here; give the others time to queue up.
				time.Sleep(50 * time.Millisecond)
				if err := tx.Commit(ctx); err != nil {
					t.Error(err)
				}
			}
		})
	}
	close(start)
	wg.Wait()
	counts := map[guard.ClaimResult]int{}
	for _, r := range results {
		counts[r]++
	}
	require.Equal(t, map[guard.ClaimResult]int{guard.ClaimInserted: 1, guard.ClaimDuplicate: n - 1}, counts)
	var rows int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM idem_processed WHERE event_id = 'hot'`).Scan(&rows))
	require.Equal(t, 1, rows)
}

// If the first claimant rolls back, a waiter inserts instead: the event is
// processed once, not zero times.
func TestWaiterTakesOverWhenFirstClaimRollsBack(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t)
	s := pgtier.New(pool)
	ctx := context.Background()
	first := claimOpen(t, s, ev("e", "a"))

	got := make(chan guard.ClaimResult, 1)
	go func() {
		tx, err := s.Begin(ctx)
		if err != nil {
			t.Error(err)
			got <- 0
			return
		}
		defer tx.Rollback(ctx)
		r, err := s.Claim(ctx, tx, "svc", []guard.Event{ev("e", "a")})
		if err != nil {
			t.Error(err)
			got <- 0
			return
		}
		got <- r[0]
	}()
	// The second claim blocks on the first one's row until it rolls back.
	waitForLockWaiter(t, pool, first)
	require.NoError(t, first.Rollback(ctx))
	require.Equal(t, guard.ClaimInserted, <-got)
}

// waitForLockWaiter polls until some backend is blocked by blocker's.
func waitForLockWaiter(t *testing.T, pool *pgxpool.Pool, blocker pgx.Tx) {
	t.Helper()
	var pid int32
	require.NoError(t, blocker.QueryRow(context.Background(), `SELECT pg_backend_pid()`).Scan(&pid))
	require.Eventually(t, func() bool {
		var n int
		err := pool.QueryRow(context.Background(),
			`SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))`, pid).Scan(&n)
		return err == nil && n > 0
	}, 10*time.Second, 5*time.Millisecond)
}

func TestBatchClaimMixesOutcomes(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t)
	s := pgtier.New(pool)
	ctx := context.Background()
	require.Equal(t, guard.ClaimInserted, claimCommit(t, s, ev("old", "a")))
	require.Equal(t, guard.ClaimInserted, claimCommit(t, s, ev("changed", "a")))
	tx, err := s.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	res, err := s.Claim(ctx, tx, "svc", []guard.Event{ev("new", "a"), ev("old", "a"), ev("changed", "b"), ev("new", "a")})
	require.NoError(t, err)
	require.Equal(t, []guard.ClaimResult{guard.ClaimInserted, guard.ClaimDuplicate, guard.ClaimConflict, guard.ClaimDuplicate}, res)
}

func TestScopesAreIndependent(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t)
	s := pgtier.New(pool)
	ctx := context.Background()
	for _, scope := range []string{"billing", "ledger"} {
		tx, err := s.Begin(ctx)
		require.NoError(t, err)
		res, err := s.Claim(ctx, tx, scope, []guard.Event{ev("e", "a")})
		require.NoError(t, err)
		require.Equal(t, guard.ClaimInserted, res[0], scope)
		require.NoError(t, tx.Commit(ctx))
	}
}

func TestPruneDeletesOnlyRowsPastRetention(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t)
	s := pgtier.New(pool)
	ctx := context.Background()
	require.Equal(t, guard.ClaimInserted, claimCommit(t, s, ev("old", "a")))
	require.Equal(t, guard.ClaimInserted, claimCommit(t, s, ev("fresh", "a")))
	_, err := pool.Exec(ctx, `UPDATE idem_processed SET processed_at = now() - interval '2 days' WHERE event_id = 'old'`)
	require.NoError(t, err)
	n, err := s.Prune(ctx, 24*time.Hour, 1)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	require.Equal(t, guard.ClaimInserted, claimCommit(t, s, ev("old", "a")))
	require.Equal(t, guard.ClaimDuplicate, claimCommit(t, s, ev("fresh", "a")))
}
