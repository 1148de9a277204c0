package pgtier_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/horizon"
	"github.com/idemhq/idem/internal/layout"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
)

func ev(id, payload string) guard.Event {
	return guard.Event{ID: id, Hash: guard.HashFields(id, payload)}
}

// at is e with the producer's time t.
func at(e guard.Event, t time.Time) guard.Event {
	e.Time = t
	return e
}

// claim claims e in a new transaction and leaves it open for the caller.
func claim(t *testing.T, s *pgtier.Store, e guard.Event) (pgx.Tx, tier.ClaimResult) {
	t.Helper()
	tx, err := s.Begin(context.Background())
	require.NoError(t, err)
	res, _, err := s.Claim(context.Background(), tx, "svc", []guard.Event{e})
	require.NoError(t, err)
	return tx, res[0]
}

func claimCommit(t *testing.T, s *pgtier.Store, e guard.Event) tier.ClaimResult {
	t.Helper()
	tx, res := claim(t, s, e)
	require.NoError(t, tx.Commit(context.Background()))
	return res
}

// claimOpen claims e, requires the insert, and leaves the transaction open.
func claimOpen(t *testing.T, s *pgtier.Store, e guard.Event) pgx.Tx {
	t.Helper()
	tx, res := claim(t, s, e)
	require.Equal(t, tier.ClaimInserted, res)
	return tx
}

func TestClaimInsertsThenReportsDuplicateOrConflict(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t, testenv.Effects)
	s := pgtier.New(pool)
	require.Equal(t, tier.ClaimInserted, claimCommit(t, s, ev("e1", "a")))
	require.Equal(t, tier.ClaimDuplicate, claimCommit(t, s, ev("e1", "a")))
	require.Equal(t, tier.ClaimConflict, claimCommit(t, s, ev("e1", "b")))
	require.Equal(t, tier.ClaimInserted, claimCommit(t, s, ev("e2", "a")))
}

func TestRolledBackClaimLeavesNoTrace(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t, testenv.Effects)
	s := pgtier.New(pool)
	tx := claimOpen(t, s, ev("e1", "a"))
	require.NoError(t, tx.Rollback(context.Background()))
	require.Equal(t, tier.ClaimInserted, claimCommit(t, s, ev("e1", "a")))
}

// Many transactions claim one event at once and hold their tx open for a
// moment, as a handler would: the unique key lets exactly one commit a row,
// the rest wait on it and then see a duplicate.
func TestConcurrentClaimsExactlyOneWins(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t, testenv.Effects)
	s := pgtier.New(pool)
	const n = 16
	results := make([]tier.ClaimResult, n)
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
			res, _, err := s.Claim(ctx, tx, "svc", []guard.Event{ev("hot", "a")})
			if err != nil {
				t.Error(err)
				return
			}
			results[i] = res[0]
			if res[0] == tier.ClaimInserted {
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
	counts := map[tier.ClaimResult]int{}
	for _, r := range results {
		counts[r]++
	}
	require.Equal(t, map[tier.ClaimResult]int{tier.ClaimInserted: 1, tier.ClaimDuplicate: n - 1}, counts)
	var rows int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM idem_processed WHERE event_id = 'hot'`).Scan(&rows))
	require.Equal(t, 1, rows)
}

// If the first claimant rolls back, a waiter inserts instead: the event is
// processed once, not zero times.
func TestWaiterTakesOverWhenFirstClaimRollsBack(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t, testenv.Effects)
	s := pgtier.New(pool)
	ctx := context.Background()
	first := claimOpen(t, s, ev("e", "a"))

	got := make(chan tier.ClaimResult, 1)
	go func() {
		tx, err := s.Begin(ctx)
		if err != nil {
			t.Error(err)
			got <- 0
			return
		}
		defer tx.Rollback(ctx)
		r, _, err := s.Claim(ctx, tx, "svc", []guard.Event{ev("e", "a")})
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
	require.Equal(t, tier.ClaimInserted, <-got)
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
	pool, _ := testenv.Schema(t, testenv.Effects)
	s := pgtier.New(pool)
	ctx := context.Background()
	require.Equal(t, tier.ClaimInserted, claimCommit(t, s, ev("old", "a")))
	require.Equal(t, tier.ClaimInserted, claimCommit(t, s, ev("changed", "a")))
	tx, err := s.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	res, _, err := s.Claim(ctx, tx, "svc", []guard.Event{ev("new", "a"), ev("old", "a"), ev("changed", "b"), ev("new", "a")})
	require.NoError(t, err)
	require.Equal(t, []tier.ClaimResult{tier.ClaimInserted, tier.ClaimDuplicate, tier.ClaimConflict, tier.ClaimDuplicate}, res)
}

func TestScopesAreIndependent(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t, testenv.Effects)
	s := pgtier.New(pool)
	ctx := context.Background()
	for _, scope := range []string{"billing", "ledger"} {
		tx, err := s.Begin(ctx)
		require.NoError(t, err)
		res, _, err := s.Claim(ctx, tx, scope, []guard.Event{ev("e", "a")})
		require.NoError(t, err)
		require.Equal(t, tier.ClaimInserted, res[0], scope)
		require.NoError(t, tx.Commit(ctx))
	}
}

func TestPruneDeletesOnlyRowsPastRetention(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t, testenv.Effects)
	s := pgtier.New(pool)
	ctx := context.Background()
	require.Equal(t, tier.ClaimInserted, claimCommit(t, s, ev("old", "a")))
	require.Equal(t, tier.ClaimInserted, claimCommit(t, s, ev("fresh", "a")))
	_, err := pool.Exec(ctx, `UPDATE idem_processed SET processed_at = now() - interval '2 days' WHERE event_id = 'old'`)
	require.NoError(t, err)
	n, cutoff, err := horizon.Prune(ctx, pool, horizon.PruneConfig{Retention: 24 * time.Hour, ClockSkew: 5 * time.Minute, Batch: 1})
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	require.WithinDuration(t, time.Now().Add(-24*time.Hour-5*time.Minute), cutoff, time.Minute)
	require.Equal(t, tier.ClaimUntimed, claimCommit(t, s, ev("old", "a")), "an untimed event after a cut")
	require.Equal(t, tier.ClaimInserted, claimCommit(t, s, at(ev("old", "a"), time.Now())), "a timed one inside the horizon")
	require.Equal(t, tier.ClaimDuplicate, claimCommit(t, s, ev("fresh", "a")))
}

// TestPruneCannotCutBelowWhatConsumersEnforce: the retention consumers
// enforce and the one prune uses live in one row, so they cannot disagree.
func TestPruneCannotCutBelowWhatConsumersEnforce(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t, testenv.Effects)
	s := pgtier.New(pool)
	ctx := context.Background()
	h, err := horizon.Enforce(ctx, pool, 30*24*time.Hour, time.Minute)
	require.NoError(t, err)
	require.Equal(t, 30*24*time.Hour, h.Retention)
	require.True(t, h.PrunedThrough.IsZero())
	// A consumer with a shorter retention does not lower the record.
	h, err = horizon.Enforce(ctx, pool, 24*time.Hour, 2*time.Minute)
	require.NoError(t, err)
	require.Equal(t, 30*24*time.Hour, h.Retention)
	require.Equal(t, 2*time.Minute, h.ClockSkew)

	require.Equal(t, tier.ClaimInserted, claimCommit(t, s, at(ev("e", "a"), time.Now())))
	_, err = pool.Exec(ctx, `UPDATE idem_processed SET processed_at = now() - interval '10 days'`)
	require.NoError(t, err)
	_, _, err = horizon.Prune(ctx, pool, horizon.PruneConfig{Retention: 7 * 24 * time.Hour, ClockSkew: time.Minute, Batch: 100})
	require.ErrorIs(t, err, horizon.ErrRetentionBelowConsumers)
	require.Equal(t, tier.ClaimDuplicate, claimCommit(t, s, at(ev("e", "a"), time.Now())), "a refused prune deletes nothing")

	// After every consumer is lowered, the operator resets the record.
	require.NoError(t, horizon.Reset(ctx, pool, 7*24*time.Hour, time.Minute))
	n, cutoff, err := horizon.Prune(ctx, pool, horizon.PruneConfig{Retention: 7 * 24 * time.Hour, ClockSkew: time.Minute, Batch: 100})
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	// A consumer starting now learns where prune cut.
	h, err = horizon.Enforce(ctx, pool, 30*24*time.Hour, time.Minute)
	require.NoError(t, err)
	require.WithinDuration(t, cutoff, h.PrunedThrough, time.Millisecond)
}

// TestClaimOfAPrunedRowIsBeyondRetention: a claim whose conflicting row is
// deleted between its INSERT and its lookup must not come back as a store
// fault (which is retried and re-applied) but as ErrBeyondRetention. The
// claim reads existing rows in the same statement as its INSERT, so it needs
// its own lookup only for a row another transaction committed while the
// INSERT waited on it: that is the race staged here.
func TestClaimOfAPrunedRowIsBeyondRetention(t *testing.T) {
	t.Parallel()
	pool, url := testenv.Schema(t, testenv.Effects)
	ctx := context.Background()

	// Another consumer holds the row, uncommitted.
	other := pgtier.New(pool)
	otherTx, err := other.Begin(ctx)
	require.NoError(t, err)
	defer otherTx.Rollback(ctx)
	res, _, err := other.Claim(ctx, otherTx, "svc", []guard.Event{ev("e", "a")})
	require.NoError(t, err)
	require.Equal(t, tier.ClaimInserted, res[0])

	// The claimer's pool prunes the row just before the claim's lookup.
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.ConnConfig.Tracer = &pruneBeforeLookup{t: t, pool: pool}
	claimer, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer claimer.Close()
	s := pgtier.New(claimer)
	tx, err := s.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	var pid uint32
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))

	// Commit the other consumer's row once the claim waits on it.
	committed := make(chan error, 1)
	go func() {
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			var waiting bool
			if err := pool.QueryRow(ctx, `SELECT wait_event_type IS NOT DISTINCT FROM 'Lock' FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&waiting); err != nil {
				committed <- err
				return
			}
			if waiting {
				committed <- otherTx.Commit(ctx)
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
		committed <- errors.New("the claim never waited on the other transaction's row")
	}()
	_, _, err = s.Claim(ctx, tx, "svc", []guard.Event{ev("e", "a")})
	require.NoError(t, <-committed)
	require.ErrorIs(t, err, guard.ErrBeyondRetention)
}

// pruneBeforeLookup deletes every dedup row when a claim's lookup starts.
type pruneBeforeLookup struct {
	t    *testing.T
	pool *pgxpool.Pool
}

func (p *pruneBeforeLookup) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.HasPrefix(d.SQL, "SELECT u.id, (SELECT p.payload_hash FROM idem_processed") {
		_, err := p.pool.Exec(ctx, `DELETE FROM idem_processed`)
		require.NoError(p.t, err)
	}
	return ctx
}

func (p *pruneBeforeLookup) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestCommitIsDurableWhateverTheServerSays: synchronous_commit=off on the
// connection must not reach the guard's transactions.
func TestCommitIsDurableWhateverTheServerSays(t *testing.T) {
	t.Parallel()
	_, url := testenv.Schema(t, testenv.Effects)
	pool, err := pgxpool.New(context.Background(), testenv.WithParam(url, "synchronous_commit", "off"))
	require.NoError(t, err)
	defer pool.Close()
	ctx := context.Background()
	var outside string
	require.NoError(t, pool.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&outside))
	require.Equal(t, "off", outside, "the test's premise")
	tx, err := pgtier.New(pool).Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	var inside string
	require.NoError(t, tx.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&inside))
	require.Equal(t, "on", inside)
}

// sqlRecorder keeps the SQL of the first statement that starts with prefix.
type sqlRecorder struct {
	prefix string
	mu     sync.Mutex
	sql    string
}

func (r *sqlRecorder) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.sql == "" && strings.HasPrefix(d.SQL, r.prefix) {
		r.sql = d.SQL
	}
	return ctx
}
func (r *sqlRecorder) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestClaimProbesTheKeyOnANewTable: on a new table, which has no statistics,
// the planner believes it tiny, and the claim's generic plan, made at first
// use, outlives that belief. The lookup of existing rows must still probe
// the primary key by both columns, not scan a whole scope for every batch.
func TestClaimProbesTheKeyOnANewTable(t *testing.T) {
	t.Parallel()
	_, url := testenv.Schema(t, testenv.Effects)
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	rec := &sqlRecorder{prefix: "WITH hist AS"}
	cfg.ConnConfig.Tracer = rec
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()
	claimCommit(t, pgtier.New(pool), ev("e", "a"))
	require.NotEmpty(t, rec.sql, "the claim statement was not seen")

	tx, err := pgtier.New(pool).Begin(ctx) // generic plans, as in every claim
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	h := guard.HashFields("x")
	rows, err := tx.Query(ctx, "EXPLAIN "+rec.sql, "svc", []string{"a", "b"}, [][]byte{h, h}, []pgtype.Timestamptz{{}, {}})
	require.NoError(t, err)
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	plan := strings.Join(lines, "\n")
	require.Regexp(t, `Index Scan using idem_processed_pkey on idem_processed p\s.*\n\s*Index Cond: \(\(scope = (\$1|'svc'::text)\) AND \(event_id = c\.id\)\)`, plan)
	require.NotContains(t, plan, "Bitmap", plan)
	require.NotContains(t, plan, "Seq Scan on idem_processed", plan)
}

// TestCheckShardRefusesAnotherPlace: a database keeps the place it was first
// given in the shard list.
func TestCheckShardRefusesAnotherPlace(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t, testenv.Effects)
	ctx := context.Background()
	require.NoError(t, layout.CheckShard(ctx, pool, 1, 3))
	require.NoError(t, layout.CheckShard(ctx, pool, 1, 3), "the same place again")
	require.ErrorIs(t, layout.CheckShard(ctx, pool, 0, 3), layout.ErrWrongShard, "reordered")
	require.ErrorIs(t, layout.CheckShard(ctx, pool, 1, 4), layout.ErrWrongShard, "resized")
	require.Error(t, layout.CheckShard(ctx, pool, 3, 3))
}

// TestCheckShardWaitsForAFirstRecorder: a consumer that checks while
// another's first record is not committed yet waits for it, then finds the
// same place, rather than failing (consumers of a fleet start together).
func TestCheckShardWaitsForAFirstRecorder(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t, testenv.Effects)
	ctx := context.Background()
	first, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer first.Rollback(ctx)
	_, err = first.Exec(ctx, `INSERT INTO idem_shard (shard, shards) VALUES (1, 2)`)
	require.NoError(t, err)

	checked := make(chan error, 1)
	go func() { checked <- layout.CheckShard(ctx, pool, 1, 2) }()
	require.Eventually(t, func() bool {
		var waiting int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE '%INSERT INTO idem_shard%'`).Scan(&waiting)
		return err == nil && waiting > 0
	}, 10*time.Second, 5*time.Millisecond, "the second check never waited for the first record")
	require.NoError(t, first.Commit(ctx))
	require.NoError(t, <-checked)
	require.ErrorIs(t, layout.CheckShard(ctx, pool, 0, 2), layout.ErrWrongShard)
}

// statementCount counts the statements a pool sends.
type statementCount struct{ n atomic.Int64 }

func (c *statementCount) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *statementCount) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestAClaimThatOnlyFindsRowsWritesInItsOwnStatement: a claim that inserts
// nothing but finds rows decides whether it needs a WAL message (so that
// its COMMIT waits for a synchronous standby as an inserting one does) and
// writes it in the claim statement itself: one round trip. Whether it
// writes one is TestAFoundOnlyClaimWritesAMessageWhereACommitWaits's, on a
// server of its own.
func TestAClaimThatOnlyFindsRowsWritesInItsOwnStatement(t *testing.T) {
	t.Parallel()
	_, url := testenv.Schema(t, testenv.Effects)
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	count := &statementCount{}
	cfg.ConnConfig.Tracer = count
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	s := pgtier.New(pool)
	require.Equal(t, tier.ClaimInserted, claimCommit(t, s, ev("e1", "a")))
	ctx := context.Background()
	for _, c := range []struct {
		name   string
		events []guard.Event
		want   tier.ClaimResult
	}{
		{"a duplicate", []guard.Event{ev("e1", "a")}, tier.ClaimDuplicate},
		{"a conflict", []guard.Event{ev("e1", "b")}, tier.ClaimConflict},
	} {
		t.Run(c.name, func(t *testing.T) {
			tx, err := s.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx)
			before := count.n.Load()
			res, _, err := s.Claim(ctx, tx, "svc", c.events)
			require.NoError(t, err)
			require.Equal(t, c.want, res[0])
			require.Equal(t, int64(1), count.n.Load()-before, "the claim took more than its own statement")
		})
	}
}
