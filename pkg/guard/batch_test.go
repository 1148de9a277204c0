package guard_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/pkg/guard"
)

// payAll appends a ledger row for each claimed event, in one statement.
func payAll(events []guard.Event) guard.BatchApplyFunc {
	return func(ctx context.Context, tx pgx.Tx, claimed []int) error {
		ids := make([]string, len(claimed))
		for k, i := range claimed {
			ids[k] = events[i].ID
		}
		_, err := tx.Exec(ctx, `INSERT INTO ledger (event_id, user_id, amount) SELECT id, 'user_1', 100 FROM unnest($1::text[]) AS t(id)`, ids)
		return err
	}
}

func outcomes(res []guard.Result) []guard.Outcome {
	out := make([]guard.Outcome, len(res))
	for i, r := range res {
		out[i] = r.Outcome
	}
	return out
}

// TestProcessBatchGivesEachEventItsOwnOutcome runs one batch holding a new
// event, two copies of another (same payload), a copy with another payload,
// an event Redis knows is done, one only Postgres knows, and one processed
// before with another payload, followed by a copy with the payload of record.
func TestProcessBatchGivesEachEventItsOwnOutcome(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := context.Background()
	inRedis, inPostgres, conflicting := event("evt_r", 1), event("evt_p", 1), event("evt_c", 1)
	for _, ev := range []guard.Event{inRedis, inPostgres, conflicting} {
		f.process(t, ev)
	}
	f.redis.Del("idem:payments:evt_p") // evicted: only Postgres knows
	f.redis.Del("idem:payments:evt_c")

	batch := []guard.Event{
		event("evt_new", 1),
		event("evt_twice", 1),
		inRedis,
		event("evt_twice", 1),
		inPostgres,
		event("evt_c", 2),
		event("evt_twice", 3),
		event("evt_c", 1), // the row's payload, behind a conflicting first copy
	}
	res, err := f.guard.ProcessBatch(ctx, batch, payAll(batch))
	require.NoError(t, err)
	require.Equal(t, []guard.Outcome{
		guard.OutcomeProcessed,
		guard.OutcomeProcessed,
		guard.OutcomeDuplicateRedis,
		guard.OutcomeDuplicateBatch,
		guard.OutcomeDuplicatePostgres,
		guard.OutcomePayloadConflict,
		guard.OutcomePayloadConflict,
		guard.OutcomeDuplicatePostgres,
	}, outcomes(res))
	require.ErrorIs(t, res[5].Err, guard.ErrPayloadConflict)
	require.ErrorIs(t, res[6].Err, guard.ErrPayloadConflict)
	for _, id := range []string{"evt_new", "evt_twice", "evt_r", "evt_p", "evt_c"} {
		require.Equal(t, 1, f.ledgerRows(t, id), id)
	}

	// The committed events are now done in Redis, written after the commit.
	require.NoError(t, f.guard.Flush(ctx))
	again := []guard.Event{event("evt_new", 1), event("evt_twice", 1), inPostgres}
	res, err = f.guard.ProcessBatch(ctx, again, payAll(again))
	require.NoError(t, err)
	require.Equal(t, []guard.Outcome{guard.OutcomeDuplicateRedis, guard.OutcomeDuplicateRedis, guard.OutcomeDuplicateRedis}, outcomes(res))
}

// TestProcessBatchFailureCommitsNothingAndFreesItsLeases: a handler error
// fails the whole batch, commits nothing and releases the batch's Redis
// leases, so the batch or its halves can run again at once.
func TestProcessBatchFailureCommitsNothingAndFreesItsLeases(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := context.Background()
	batch := []guard.Event{event("evt_a", 1), event("evt_b", 1), event("evt_c", 1)}
	boom := errors.New("boom")
	_, err := f.guard.ProcessBatch(ctx, batch, func(ctx context.Context, tx pgx.Tx, claimed []int) error {
		if err := payAll(batch)(ctx, tx, claimed); err != nil {
			return err
		}
		return boom
	})
	var se *guard.StoreError
	require.False(t, errors.As(err, &se), "apply's failure is not the store's")
	require.ErrorIs(t, err, boom)
	for _, ev := range batch {
		require.Zero(t, f.ledgerRows(t, ev.ID))
		require.False(t, f.redis.Exists("idem:payments:"+ev.ID), "lease of %s released", ev.ID)
	}
	res, err := f.guard.ProcessBatch(ctx, batch[:1], payAll(batch[:1]))
	require.NoError(t, err)
	require.Equal(t, guard.OutcomeProcessed, res[0].Outcome)
}
