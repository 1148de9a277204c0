package pgtier

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/guard"
)

// walRuns runs the claim statement under EXPLAIN ANALYZE in a transaction
// of s (generic plan, as Begin pins), and returns how many times the wal
// CTE produced its row (the message written), and whether the transaction
// then has an ID.
func walRuns(t *testing.T, s *Store, events []guard.Event) (messages int, xid bool, plan string) {
	t.Helper()
	ctx := context.Background()
	tx, err := s.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	ids := make([]string, len(events))
	hashes := make([][]byte, len(events))
	times := make([]pgtype.Timestamptz, len(events))
	for i, ev := range events {
		ids[i], hashes[i] = ev.ID, ev.Hash
		times[i] = pgtype.Timestamptz{Time: ev.Time, Valid: !ev.Time.IsZero()}
	}
	var out []byte
	require.NoError(t, tx.QueryRow(ctx, `EXPLAIN (ANALYZE, FORMAT JSON) `+claim, "svc", ids, hashes, times).Scan(&out))
	var doc []struct{ Plan map[string]any }
	require.NoError(t, json.Unmarshal(out, &doc))
	var walk func(n map[string]any)
	walk = func(n map[string]any) {
		if n["Subplan Name"] == "CTE wal" {
			messages += int(n["Actual Rows"].(float64) * n["Actual Loops"].(float64))
		}
		if kids, ok := n["Plans"].([]any); ok {
			for _, k := range kids {
				walk(k.(map[string]any))
			}
		}
	}
	walk(doc[0].Plan)
	var x *int64
	require.NoError(t, tx.QueryRow(ctx, `SELECT txid_current_if_assigned()`).Scan(&x))
	return messages, x != nil, string(out)
}

// TestAClaimThatInsertsNothingWritesOneWALMessage: the claim statement's
// wal CTE runs exactly once (EXPLAIN ANALYZE counts its row) whenever the
// claim inserts nothing, whatever it found (one row, many, refused ones,
// none), under the generic plan the transaction pins; and not at all when
// it inserts, whose own write gives the transaction its ID.
func TestAClaimThatInsertsNothingWritesOneWALMessage(t *testing.T) {
	pool, _ := testenv.Schema(t)
	s := New(pool)
	ctx := context.Background()
	ev := func(id string) guard.Event { return guard.Event{ID: id, Hash: guard.HashFields(id)} }
	commit := func(evs ...guard.Event) {
		tx, err := s.Begin(ctx)
		require.NoError(t, err)
		_, _, err = s.Claim(ctx, tx, "svc", evs)
		require.NoError(t, err)
		require.NoError(t, tx.Commit(ctx))
	}
	commit(ev("a"), ev("b"), ev("c"))
	var many []guard.Event
	for i := range 200 {
		e := ev(string(rune('A'+i%26)) + time.Duration(i).String())
		many = append(many, e)
	}
	commit(many...)
	old := time.Now().Add(-1000 * time.Hour)
	cases := []struct {
		name     string
		events   []guard.Event
		messages int
	}{
		{"one found", []guard.Event{ev("a")}, 1},
		{"three found", []guard.Event{ev("a"), ev("b"), ev("c")}, 1},
		{"two hundred found", many, 1},
		{"found and new", []guard.Event{ev("a"), ev("new1")}, 0},
		{"new only", []guard.Event{ev("new2")}, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			n, xid, plan := walRuns(t, s, c.events)
			require.Equal(t, c.messages, n, plan)
			require.True(t, xid)
		})
	}
	// Refusals need a horizon.
	_, err := pool.Exec(ctx, `INSERT INTO idem_horizon (retention, clock_skew, pruned_through) VALUES ('1 hour', '1 second', now() - interval '1 minute')`)
	require.NoError(t, err)
	expired := func(id string) guard.Event { e := ev(id); e.Time = old; return e }
	for _, c := range []struct {
		name     string
		events   []guard.Event
		messages int
	}{
		{"found but expired", []guard.Event{expired("a")}, 1},
		{"all refused, none found", []guard.Event{expired("zz1"), expired("zz2")}, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			n, xid, plan := walRuns(t, s, c.events)
			t.Logf("%s: messages %d xid %v", c.name, n, xid)
			require.Equal(t, c.messages, n, plan)
		})
	}
}
