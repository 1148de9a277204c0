package pgtier_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/horizon"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
)

// TestClaimEnforcesTheRecordedHorizon: the claim itself refuses an event
// whose row it may have pruned, by the values idem_horizon records and the
// database's clock, and never refuses one whose row exists.
func TestClaimEnforcesTheRecordedHorizon(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t, testenv.Effects)
	s := pgtier.New(pool)
	ctx := context.Background()
	now := time.Now()
	_, err := horizon.Enforce(ctx, pool, time.Hour, time.Minute)
	require.NoError(t, err)

	for _, c := range []struct {
		name string
		at   time.Time
		want tier.ClaimResult
	}{
		{"fresh", now.Add(-10 * time.Minute), tier.ClaimInserted},
		{"inside the retention", now.Add(-59 * time.Minute), tier.ClaimInserted},
		{"past the retention", now.Add(-61 * time.Minute), tier.ClaimExpired},
		{"ahead within the recorded skew", now.Add(30 * time.Second), tier.ClaimInserted},
		// A consumer allowing 5 minutes (the library's default) let this
		// through; the recorded skew is the one enforced.
		{"ahead past the recorded skew", now.Add(4 * time.Minute), tier.ClaimFuture},
		{"untimed, nothing pruned yet", time.Time{}, tier.ClaimInserted},
	} {
		require.Equal(t, c.want, claimCommit(t, s, at(ev("e_"+c.name, "a"), c.at)), c.name)
	}
	require.Equal(t, tier.ClaimDuplicate, claimCommit(t, s, at(ev("e_fresh", "a"), now.Add(-2*time.Hour))),
		"an event whose row exists is a duplicate, however old")

	// The first cut is refused while untimed events arrive, then made.
	cut := horizon.PruneConfig{Retention: time.Hour, ClockSkew: time.Minute, Batch: 100}
	_, _, err = horizon.Prune(ctx, pool, cut)
	require.ErrorIs(t, err, horizon.ErrUntimedStillArriving)
	cut.CutUntimed = true
	_, pruned, err := horizon.Prune(ctx, pool, cut)
	require.NoError(t, err)

	require.Equal(t, tier.ClaimUntimed, claimCommit(t, s, ev("e_new_untimed", "a")), "untimed after a cut")
	require.Equal(t, tier.ClaimDuplicate, claimCommit(t, s, ev("e_untimed, nothing pruned yet", "a")), "untimed with its row")

	// A longer retention recorded after the cut still refuses what the cut
	// may have taken.
	_, err = horizon.Enforce(ctx, pool, 2*time.Hour, time.Minute)
	require.NoError(t, err)
	require.Equal(t, tier.ClaimExpired, claimCommit(t, s, at(ev("e_before_cut", "a"), pruned.Add(30*time.Second))))
	require.Equal(t, tier.ClaimInserted, claimCommit(t, s, at(ev("e_after_cut", "a"), pruned.Add(90*time.Second))))
}

// TestClaimChecksTheHorizonWhenTheRowIsClaimed: a delivery decoded inside the
// horizon is held (Postgres unreachable for this consumer) until it is past
// it; meanwhile another process prunes its row. The claim must refuse it,
// not insert a fresh row and apply it a second time.
func TestClaimChecksTheHorizonWhenTheRowIsClaimed(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t, testenv.Effects)
	s := pgtier.New(pool)
	ctx := context.Background()
	_, err := horizon.Enforce(ctx, pool, time.Hour, time.Minute)
	require.NoError(t, err)
	// Processed when it happened, 59 minutes ago: inside the horizon when
	// its redelivery was decoded.
	happened := time.Now().Add(-59 * time.Minute)
	e := at(ev("e_held", "a"), happened)
	require.Equal(t, tier.ClaimInserted, claimCommit(t, s, e))
	_, err = pool.Exec(ctx, `UPDATE idem_processed SET processed_at = $1`, happened)
	require.NoError(t, err)
	// The hold lasts three minutes: everything is three minutes older.
	_, err = pool.Exec(ctx, `UPDATE idem_processed SET processed_at = processed_at - interval '3 minutes'`)
	require.NoError(t, err)
	e.Time = happened.Add(-3 * time.Minute)
	n, _, err := horizon.Prune(ctx, pool, horizon.PruneConfig{Retention: time.Hour, ClockSkew: time.Minute, Batch: 100})
	require.NoError(t, err)
	require.Equal(t, int64(1), n, "the row was pruned")
	require.Equal(t, tier.ClaimExpired, claimCommit(t, s, e), "the held delivery was claimed again")
}

// TestPruneWaitsForClaimsBegunBeforeTheCut: a guard transaction that began
// before prune recorded its cut may have read the old horizon; prune deletes
// nothing until it ends.
func TestPruneWaitsForClaimsBegunBeforeTheCut(t *testing.T) {
	t.Parallel()
	_, url := testenv.Schema(t, testenv.Effects)
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["application_name"] = "prune-barrier-" + t.Name()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()
	s := pgtier.New(pool)
	require.Equal(t, tier.ClaimInserted, claimCommit(t, s, at(ev("old", "a"), time.Now())))
	_, err = pool.Exec(ctx, `UPDATE idem_processed SET processed_at = now() - interval '2 days'`)
	require.NoError(t, err)

	open, err := s.Begin(ctx) // a claim in flight
	require.NoError(t, err)
	defer open.Rollback(ctx) // before pool.Close, which waits for it
	type pruned struct {
		n   int64
		err error
	}
	done := make(chan pruned, 1)
	go func() {
		n, _, err := horizon.Prune(ctx, pool, horizon.PruneConfig{Retention: 24 * time.Hour, ClockSkew: time.Minute, Batch: 100})
		done <- pruned{n, err}
	}()
	// Prune waits for the open claim, its cut recorded and the row still
	// there.
	var cut *time.Time
	require.Eventually(t, func() bool {
		require.NoError(t, pool.QueryRow(ctx, `SELECT max(pruned_through) FROM idem_horizon`).Scan(&cut))
		return cut != nil
	}, 10*time.Second, 10*time.Millisecond, "the cut is recorded before the wait")
	time.Sleep(300 * time.Millisecond)
	select {
	case p := <-done:
		t.Fatalf("prune passed an open claim: %d rows, %v", p.n, p.err)
	default:
	}
	var rows int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM idem_processed`).Scan(&rows))
	require.Equal(t, 1, rows, "prune deleted a row under an open claim")

	require.NoError(t, open.Commit(ctx))
	select {
	case p := <-done:
		require.NoError(t, p.err)
		require.Equal(t, int64(1), p.n)
	case <-time.After(10 * time.Second):
		t.Fatal("prune did not go on once the claim ended")
	}
}

// TestHorizonRefusesAZeroClockSkew: a zero skew is refused, not recorded as
// zero while something else is enforced.
func TestHorizonRefusesAZeroClockSkew(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t, testenv.Effects)
	_, err := horizon.Enforce(context.Background(), pool, time.Hour, 0)
	require.ErrorContains(t, err, "positive retention and clock skew")
	_, _, err = horizon.Prune(context.Background(), pool, horizon.PruneConfig{Retention: time.Hour, Batch: 1})
	require.ErrorContains(t, err, "positive retention, clock skew")
}

// TestAnUntimedClaimIsRecordedOnceItCommits: untimed_claimed_at is written
// at most once a minute, in a claim's transaction. A first write that rolls
// back must be made again by the next untimed claim, or prune would make its
// first cut without --cut-untimed while untimed events arrive; a write still
// in flight is waited for.
func TestAnUntimedClaimIsRecordedOnceItCommits(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t, testenv.Effects)
	s := pgtier.New(pool)
	ctx := context.Background()
	_, err := horizon.Enforce(ctx, pool, time.Hour, time.Minute)
	require.NoError(t, err)
	recorded := func() bool {
		var at *time.Time
		require.NoError(t, pool.QueryRow(ctx, `SELECT untimed_claimed_at FROM idem_horizon`).Scan(&at))
		return at != nil
	}

	tx := claimOpen(t, s, ev("e_rolled_back", "a"))
	require.NoError(t, tx.Rollback(ctx))
	require.False(t, recorded())
	require.Equal(t, tier.ClaimInserted, claimCommit(t, s, ev("e_next", "a")))
	require.True(t, recorded(), "the rolled-back write was not made again")
	_, _, err = horizon.Prune(ctx, pool, horizon.PruneConfig{Retention: time.Hour, ClockSkew: time.Minute, Batch: 100})
	require.ErrorIs(t, err, horizon.ErrUntimedStillArriving)

	// Once a claim found the write in place, the next claims within the
	// minute write nothing.
	require.Equal(t, tier.ClaimInserted, claimCommit(t, s, ev("e_third", "a")))
	_, err = pool.Exec(ctx, `UPDATE idem_horizon SET untimed_claimed_at = NULL`)
	require.NoError(t, err)
	require.Equal(t, tier.ClaimInserted, claimCommit(t, s, ev("e_fourth", "a")))
	require.False(t, recorded(), "written again within the minute")
}

// TestAnUntimedClaimWaitsForTheWriteInFlight: a claim that finds the last
// write not yet committed waits for its transaction, and writes again if it
// rolled back.
func TestAnUntimedClaimWaitsForTheWriteInFlight(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t, testenv.Effects)
	s := pgtier.New(pool)
	ctx := context.Background()
	_, err := horizon.Enforce(ctx, pool, time.Hour, time.Minute)
	require.NoError(t, err)

	first := claimOpen(t, s, ev("e_first", "a")) // wrote, not committed
	defer first.Rollback(ctx)                    // on failure: its locks would hold up the schema's drop
	done := make(chan error, 1)
	go func() {
		tx, err := s.Begin(ctx)
		if err == nil {
			_, _, err = s.Claim(ctx, tx, "svc", []guard.Event{ev("e_second", "a")})
			err = errors.Join(err, tx.Commit(ctx))
		}
		done <- err
	}()
	pid := first.Conn().PgConn().PID()
	require.Eventually(t, func() bool {
		var waits bool
		require.NoError(t, pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid)))`, pid).Scan(&waits))
		return waits
	}, 10*time.Second, 10*time.Millisecond, "the second claim did not wait for the first")
	require.NoError(t, first.Rollback(ctx))
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("the second claim did not end once the first rolled back")
	}
	var at *time.Time
	require.NoError(t, pool.QueryRow(ctx, `SELECT untimed_claimed_at FROM idem_horizon`).Scan(&at))
	require.NotNil(t, at, "the second claim did not write what the first rolled back")
}

// TestAPruneWaitingOnALongClaimQueuesNoOtherClaim: a guard transaction
// runs long (a handler near its timeout) while a prune waits for it at its
// barrier. The barrier was an exclusive request for the horizon lock, and
// PostgreSQL queues every later request behind it, so every claim begun
// meanwhile waited on the long one and failed at its lock_timeout (55P03):
// a prune during load failed healthy events by the handful. Now the prune
// waits for the transactions that held the lock when it recorded its cut
// without asking for it: claims pass, and the prune cuts once the long
// transaction ends, not before.
func TestAPruneWaitingOnALongClaimQueuesNoOtherClaim(t *testing.T) {
	t.Parallel()
	pool, dbURL := testenv.Schema(t, testenv.Effects)
	ctx := context.Background()
	_, err := horizon.Enforce(ctx, pool, time.Hour, time.Minute)
	require.NoError(t, err)

	long, err := pgtier.New(pool).Begin(ctx)
	require.NoError(t, err)
	defer long.Rollback(ctx)

	pruned := make(chan error, 1)
	go func() {
		_, _, err := horizon.Prune(ctx, pool, horizon.PruneConfig{Retention: time.Hour, ClockSkew: time.Minute, Batch: 100})
		pruned <- err
	}()
	// The prune waits for the long transaction.
	time.Sleep(300 * time.Millisecond)
	select {
	case err := <-pruned:
		t.Fatalf("prune passed its barrier while a transaction begun before the cut ran: %v", err)
	default:
	}

	// Claims begun meanwhile, with the lock_timeout consumers run with
	// at a 2 s handler timeout.
	pc, err := pgxpool.ParseConfig(testenv.WithParam(dbURL, "lock_timeout", "1000"))
	require.NoError(t, err)
	claims, err := pgxpool.NewWithConfig(ctx, pc)
	require.NoError(t, err)
	defer claims.Close()
	for i := range 5 {
		tx, err := pgtier.New(claims).Begin(ctx)
		require.NoError(t, err, "claim %d queued behind the prune", i)
		require.NoError(t, tx.Commit(ctx))
		time.Sleep(150 * time.Millisecond)
	}
	select {
	case err := <-pruned:
		t.Fatalf("prune passed its barrier while a transaction begun before the cut ran: %v", err)
	default:
	}

	require.NoError(t, long.Rollback(ctx))
	select {
	case err := <-pruned:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("prune did not finish after the long transaction ended")
	}
}
