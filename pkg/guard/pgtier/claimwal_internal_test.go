package pgtier

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/guard"
)

// walRuns runs the claim statement under EXPLAIN ANALYZE in a transaction
// of s (generic plan, as Begin pins), and returns how many times the wal
// CTE produced its row (the message written), and whether the transaction
// then has an ID.
func walRuns(t *testing.T, s *Store, events []guard.Event) (messages int, xid bool, plan string) {
	return walRunsOf(t, s, claim, events)
}

// waiting is the claim statement as it runs on a server whose COMMIT waits
// for a synchronous standby: a claim that inserts nothing always writes
// its message.
var waiting = strings.Replace(claim, durable, "false", 1)

func walRunsOf(t *testing.T, s *Store, stmt string, events []guard.Event) (messages int, xid bool, plan string) {
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
	require.NoError(t, tx.QueryRow(ctx, `EXPLAIN (ANALYZE, FORMAT JSON) `+stmt, "svc", ids, hashes, times).Scan(&out))
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

// TestAClaimThatInsertsNothingWritesOneWALMessage: where a COMMIT waits
// for a standby, the claim statement's wal CTE runs exactly once (EXPLAIN ANALYZE counts its row) whenever the
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
			n, xid, plan := walRunsOf(t, s, waiting, c.events)
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
			n, xid, plan := walRunsOf(t, s, waiting, c.events)
			t.Logf("%s: messages %d xid %v", c.name, n, xid)
			require.Equal(t, c.messages, n, plan)
		})
	}
}

// TestAFoundOnlyClaimWritesAMessageWhereACommitWaits: on a server of the
// test's own, a claim that only finds rows writes its WAL message when a
// COMMIT would wait for something the rows found may lack (a synchronous
// standby is configured), and writes nothing when everything it can have
// found is flushed and no standby is waited for: a stream of duplicates
// then commits nothing (a WAL flush per transaction halved their rate).
func TestAFoundOnlyClaimWritesAMessageWhereACommitWaits(t *testing.T) {
	t.Parallel()
	pg, err := sandbox.StartPostgres("")
	if errors.Is(err, sandbox.ErrNoInitdb) {
		t.Skip(err)
	}
	require.NoError(t, err)
	t.Cleanup(pg.Remove)
	pool, _ := testenv.SchemaOn(t, pg.URL())
	s := New(pool)
	ctx := context.Background()
	ev := guard.Event{ID: "a", Hash: guard.HashFields("a")}
	tx, err := s.Begin(ctx)
	require.NoError(t, err)
	_, _, err = s.Claim(ctx, tx, "svc", []guard.Event{ev})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))

	// Nothing else writes on this server, but a background process may
	// (autovacuum): some claim in a few finds the WAL flushed.
	require.Eventually(t, func() bool {
		n, xid, _ := walRuns(t, s, []guard.Event{ev})
		return n == 0 && !xid
	}, 10*time.Second, 50*time.Millisecond, "a found-only claim wrote a WAL message with nothing to wait for")

	_, err = pool.Exec(ctx, `ALTER SYSTEM SET synchronous_standby_names = 'nobody'`)
	require.NoError(t, err)
	// Before the schema is dropped, whose COMMIT would wait for 'nobody'.
	t.Cleanup(func() {
		_, _ = pool.Exec(ctx, `ALTER SYSTEM RESET synchronous_standby_names`)
		_, _ = pool.Exec(ctx, `SELECT pg_reload_conf()`)
		for range 100 {
			var names string
			if pool.QueryRow(ctx, `SHOW synchronous_standby_names`).Scan(&names) != nil || names == "" {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
	_, err = pool.Exec(ctx, `SELECT pg_reload_conf()`)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		var names string
		require.NoError(t, pool.QueryRow(ctx, `SHOW synchronous_standby_names`).Scan(&names))
		return names == "nobody"
	}, 10*time.Second, 20*time.Millisecond)
	for range 5 {
		n, xid, plan := walRuns(t, s, []guard.Event{ev})
		require.Equal(t, 1, n, plan)
		require.True(t, xid, "the claim left the transaction without an ID: its COMMIT would not wait for the standby")
	}
}
