package guard_test

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/step"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/guard/redistier"
)

type fixture struct {
	pool  *pgxpool.Pool
	url   string // the pool's DATABASE_URL
	redis *miniredis.Miniredis
	fast  *redistier.Filter
	guard *guard.Guard
	steps []string
	mu    sync.Mutex
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	f := &fixture{}
	f.pool, f.url = testenv.Schema(t, testenv.Effects)
	f.redis = miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: f.redis.Addr(), ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { rdb.Close() })
	var err error
	f.fast, err = redistier.New(rdb, redistier.Config{Breaker: redistier.BreakerConfig{FailureThreshold: 1000}})
	require.NoError(t, err)
	f.guard, err = guard.New(guard.Config{
		Scope: "payments",
		Store: pgtier.New(f.pool),
		Fast:  f.fast,
	})
	require.NoError(t, err)
	return f
}

func event(id string, amount int) guard.Event {
	return guard.Event{ID: id, Hash: guard.HashFields(id, "user_1", string(rune('0'+amount)))}
}

// pay is a non-idempotent effect: every call appends a ledger row.
func pay(id string) guard.ApplyFunc {
	return func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO ledger (event_id, user_id, amount) VALUES ($1, 'user_1', 100)`, id)
		return err
	}
}

func (f *fixture) ledgerRows(t *testing.T, id string) int {
	t.Helper()
	var n int
	require.NoError(t, f.pool.QueryRow(context.Background(), `SELECT count(*) FROM ledger WHERE event_id = $1`, id).Scan(&n))
	return n
}

func (f *fixture) process(t *testing.T, ev guard.Event) guard.Outcome {
	t.Helper()
	ctx := step.WithHook(context.Background(), func(_ context.Context, s string) {
		f.mu.Lock()
		f.steps = append(f.steps, s)
		f.mu.Unlock()
	})
	o, err := f.guard.Process(ctx, ev, pay(ev.ID))
	require.NoError(t, err)
	// Done markers are written after the commit, off the caller's path.
	require.NoError(t, f.guard.Flush(context.Background()))
	return o
}

func TestProcessThenDuplicateCaughtByRedis(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ev := event("evt_1", 1)
	require.Equal(t, guard.OutcomeProcessed, f.process(t, ev))
	require.Equal(t, []string{step.FastClaimed, step.StoreClaimed, step.Applied, step.Committed}, f.steps)
	require.Equal(t, guard.OutcomeDuplicateRedis, f.process(t, ev))
	require.Equal(t, 1, f.ledgerRows(t, ev.ID))
}

func TestRedisFlushedDuplicateCaughtByPostgres(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ev := event("evt_1", 1)
	require.Equal(t, guard.OutcomeProcessed, f.process(t, ev))
	f.redis.FlushAll()
	require.Equal(t, guard.OutcomeDuplicatePostgres, f.process(t, ev))
	// The duplicate refreshed the done marker, so the next one is cheap again.
	require.Equal(t, guard.OutcomeDuplicateRedis, f.process(t, ev))
	require.Equal(t, 1, f.ledgerRows(t, ev.ID))
}

func TestRedisDownChangesNothingButCost(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	a, b := event("evt_a", 1), event("evt_b", 2)
	require.Equal(t, guard.OutcomeProcessed, f.process(t, a))
	f.redis.Close()
	require.Equal(t, guard.OutcomeDuplicatePostgres, f.process(t, a))
	require.Equal(t, guard.OutcomeProcessed, f.process(t, b))
	require.Equal(t, guard.OutcomeDuplicatePostgres, f.process(t, b))
	require.Equal(t, 1, f.ledgerRows(t, a.ID))
	require.Equal(t, 1, f.ledgerRows(t, b.ID))
}

// A consumer that died after its SET NX left a pending lease. The next
// delivery must not be dropped: it goes to Postgres and is processed.
func TestOrphanedLeaseNeverLosesTheEvent(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ev := event("evt_1", 1)
	r := f.fast.Claim(context.Background(), "payments", "", []guard.Event{ev})[0]
	require.Equal(t, tier.FastAcquired, r.State) // ... and the claimant dies here
	require.Equal(t, guard.OutcomeProcessed, f.process(t, ev))
	require.Equal(t, 1, f.ledgerRows(t, ev.ID))
}

func TestHandlerErrorRollsBackAndReleasesLease(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ev := event("evt_1", 1)
	boom := errors.New("boom")
	o, err := f.guard.Process(context.Background(), ev, func(ctx context.Context, tx pgx.Tx) error {
		if err := pay(ev.ID)(ctx, tx); err != nil {
			return err
		}
		return boom
	})
	require.ErrorIs(t, err, boom)
	var se *guard.StoreError
	require.False(t, errors.As(err, &se), "apply's failure is not the store's")
	require.Equal(t, guard.OutcomeUnknown, o)
	require.Equal(t, 0, f.ledgerRows(t, ev.ID), "the effect must roll back with the dedup row")
	// Our lease was released, so the retry acquires at once.
	r := f.fast.Claim(context.Background(), "payments", "", []guard.Event{ev})[0]
	require.Equal(t, tier.FastAcquired, r.State)
	require.NoError(t, f.fast.Release(context.Background(), "payments", []tier.Lease{{ID: ev.ID, Token: r.Token}}))
	require.Equal(t, guard.OutcomeProcessed, f.process(t, ev))
	require.Equal(t, 1, f.ledgerRows(t, ev.ID))
}

func TestSameIDDifferentPayloadIsAConflict(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	require.Equal(t, guard.OutcomeProcessed, f.process(t, event("evt_1", 1)))
	for _, flushed := range []bool{false, true} { // Redis marker present, then gone
		if flushed {
			f.redis.FlushAll()
		}
		o, err := f.guard.Process(context.Background(), event("evt_1", 2), pay("evt_1"))
		require.ErrorIs(t, err, guard.ErrPayloadConflict)
		require.Equal(t, guard.OutcomePayloadConflict, o)
	}
	require.Equal(t, 1, f.ledgerRows(t, "evt_1"))
}

func TestConcurrentDeliveriesApplyOnce(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	const n = 12
	ev := event("evt_hot", 1)
	outcomes := make([]guard.Outcome, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			o, err := f.guard.Process(context.Background(), ev, func(ctx context.Context, tx pgx.Tx) error {
				time.Sleep(20 * time.Millisecond) // a handler that takes a while
				return pay(ev.ID)(ctx, tx)
			})
			if err != nil {
				t.Error(err)
			}
			outcomes[i] = o
		})
	}
	close(start)
	wg.Wait()
	processed := 0
	for _, o := range outcomes {
		if o == guard.OutcomeProcessed {
			processed++
		} else {
			require.True(t, o.IsDuplicate(), "outcome %s", o)
		}
	}
	require.Equal(t, 1, processed)
	require.Equal(t, 1, f.ledgerRows(t, ev.ID))
}

func TestWithoutFastTierPostgresAloneGuards(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t, testenv.Effects)
	g, err := guard.New(guard.Config{Scope: "payments", Store: pgtier.New(pool)})
	require.NoError(t, err)
	ev := event("evt_1", 1)
	o, err := g.Process(context.Background(), ev, pay(ev.ID))
	require.NoError(t, err)
	require.Equal(t, guard.OutcomeProcessed, o)
	o, err = g.Process(context.Background(), ev, pay(ev.ID))
	require.NoError(t, err)
	require.Equal(t, guard.OutcomeDuplicatePostgres, o)
}

func TestRejectsBadInput(t *testing.T) {
	t.Parallel()
	_, err := guard.New(guard.Config{Scope: "a:b", Store: pgtier.New(nil)})
	require.ErrorContains(t, err, "Scope")
	_, err = guard.New(guard.Config{Scope: "ok"})
	require.ErrorContains(t, err, "Store")
	g, err := guard.New(guard.Config{Scope: "ok", Store: pgtier.New(nil)})
	require.NoError(t, err)
	for _, ev := range []guard.Event{
		{ID: "", Hash: []byte{1}},
		{ID: string(make([]byte, guard.MaxIDLen+1)), Hash: []byte{1}},
		{ID: "evt\x001", Hash: []byte{1}},
		{ID: "acct\xff", Hash: []byte{1}},
		{ID: "evt_1"},
	} {
		_, err := g.Process(context.Background(), ev, nil)
		require.Error(t, err, "%q", ev.ID)
	}
}

// TestAStoreWithoutMarkersIsNeverTrustedByAFastTier: a store whose claims
// leave the history out (pgtier.Options.NoMarkers) reports none, which
// confirms no marker; beside a fast tier (a misuse: idem.Service sets it
// only without Redis) its events get no done marker and their leases go,
// so their re-sends go to Postgres, which finds them; a marker another
// guard wrote is confirmed only by a read of the history (History reads
// it in full). Alone, it processes once and finds the re-send.
func TestAStoreWithoutMarkersIsNeverTrustedByAFastTier(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := context.Background()
	st, err := pgtier.NewWith(f.pool, pgtier.Options{NoMarkers: true})
	require.NoError(t, err)

	full := f.guard
	marked := event("evt_marked", 1)
	require.Equal(t, guard.OutcomeProcessed, f.process(t, marked))
	require.NoError(t, full.Flush(ctx))

	var logs testenv.LogBuffer
	f.guard, err = guard.New(guard.Config{Scope: "payments", Store: st, Fast: f.fast,
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	require.NoError(t, err)
	ev := event("evt_nomarkers", 1)
	require.Equal(t, guard.OutcomeProcessed, f.process(t, ev))
	require.NoError(t, f.guard.Flush(ctx))
	for _, k := range f.redis.Keys() {
		require.NotContains(t, k, ev.ID, "a marker (or the lease) left for a claim that reported no history")
	}
	require.Equal(t, guard.OutcomeDuplicatePostgres, f.process(t, ev))
	// Its History reads the database's: a marker of a full store is
	// confirmed by that read, as on any store.
	require.Equal(t, guard.OutcomeDuplicateRedis, f.process(t, marked))
	require.Equal(t, 1, f.ledgerRows(t, ev.ID))
	require.Equal(t, 1, f.ledgerRows(t, marked.ID))
	// Its claims' empty history, after the read's, is no history at all,
	// not a change of it.
	require.Equal(t, guard.OutcomeProcessed, f.process(t, event("evt_after_the_read", 1)))
	require.NotContains(t, logs.String(), "history changed")

	f.guard, err = guard.New(guard.Config{Scope: "payments", Store: st})
	require.NoError(t, err)
	alone := event("evt_alone", 1)
	require.Equal(t, guard.OutcomeProcessed, f.process(t, alone))
	require.Equal(t, guard.OutcomeDuplicatePostgres, f.process(t, alone))
	require.Equal(t, 1, f.ledgerRows(t, alone.ID))
}
