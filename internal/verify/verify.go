// Package verify checks the payments tables against a publish manifest:
// every distinct event applied exactly once, no event missing, every balance
// equal to the sum of its user's payments.
package verify

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/internal/loadgen"
	"github.com/idemhq/idem/pkg/partition"
)

// Report is the result of one check.
type Report struct {
	RunID           string
	Distinct        int   // distinct events in the manifest
	Messages        int   // messages published, duplicates included
	LedgerRows      int64 // ledger rows for the run's events
	ExactlyOnce     int   // events with exactly one ledger row of the right amount
	Doubled         int   // events with more than one ledger row
	Missing         int   // events with no ledger row
	WrongAmount     int   // events whose ledger amount differs from the manifest
	Strays          int64 // ledger rows of this run for events not in the manifest
	Users           int
	BalanceMismatch int // users whose balance differs from the sum of their payments
	Shards          int // databases checked
	// Misrouted counts ledger rows and balances on a shard other than
	// their user's (partition.Of(userId, shards)).
	Misrouted int64
}

// OK reports whether nothing was doubled, lost, changed or misrouted.
func (r Report) OK() bool {
	return r.Doubled == 0 && r.Missing == 0 && r.WrongAmount == 0 && r.Strays == 0 && r.BalanceMismatch == 0 && r.Misrouted == 0
}

// Check compares the database with m once.
func Check(ctx context.Context, pool *pgxpool.Pool, m loadgen.Manifest) (Report, error) {
	return CheckShards(ctx, []*pgxpool.Pool{pool}, m)
}

// CheckShards compares the shards, in shard order, with m once: an event's
// ledger rows and a user's balance are counted wherever they are, and each
// row on a shard its user does not map to is counted as misrouted.
func CheckShards(ctx context.Context, pools []*pgxpool.Pool, m loadgen.Manifest) (Report, error) {
	r := Report{RunID: m.RunID, Distinct: len(m.Events), Messages: m.Messages, Shards: len(pools)}
	ids := make([]string, len(m.Events))
	want := map[string]int64{}
	userWant := map[string]int64{}
	for i, ev := range m.Events {
		ids[i] = ev.EventID
		want[ev.EventID] = ev.Amount
		userWant[ev.UserID] += ev.Amount
	}
	r.Users = len(userWant)

	type ledger struct{ n, lo, hi int64 }
	byEvent := map[string]ledger{}
	users := make([]string, 0, len(userWant))
	for u := range userWant {
		users = append(users, u)
	}
	got := map[string]int64{}
	var total int64
	for shard, pool := range pools {
		var elsewhere []string // the run's users that map to another shard
		for _, u := range users {
			if partition.Of(u, len(pools)) != shard {
				elsewhere = append(elsewhere, u)
			}
		}
		rows, err := pool.Query(ctx, `SELECT event_id, count(*), min(amount), max(amount)
			FROM payments_ledger WHERE event_id = ANY($1) GROUP BY event_id`, ids)
		if err != nil {
			return r, fmt.Errorf("verify: read ledger: %w", err)
		}
		for rows.Next() {
			var id string
			var l ledger
			if err := rows.Scan(&id, &l.n, &l.lo, &l.hi); err != nil {
				rows.Close()
				return r, fmt.Errorf("verify: read ledger: %w", err)
			}
			if prev, ok := byEvent[id]; ok {
				l = ledger{prev.n + l.n, min(prev.lo, l.lo), max(prev.hi, l.hi)}
			}
			byEvent[id] = l
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return r, fmt.Errorf("verify: read ledger: %w", err)
		}
		var n, misrouted int64
		if err := pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE user_id = ANY($2))
			FROM payments_ledger WHERE starts_with(event_id, $1)`, "evt_"+m.RunID+"_", elsewhere).Scan(&n, &misrouted); err != nil {
			return r, fmt.Errorf("verify: count run rows: %w", err)
		}
		total += n
		r.Misrouted += misrouted

		brows, err := pool.Query(ctx, `SELECT user_id, balance FROM account_balances WHERE user_id = ANY($1)`, users)
		if err != nil {
			return r, fmt.Errorf("verify: read balances: %w", err)
		}
		for brows.Next() {
			var u string
			var b int64
			if err := brows.Scan(&u, &b); err != nil {
				brows.Close()
				return r, fmt.Errorf("verify: read balances: %w", err)
			}
			got[u] += b
			if partition.Of(u, len(pools)) != shard {
				r.Misrouted++
			}
		}
		brows.Close()
		if err := brows.Err(); err != nil {
			return r, fmt.Errorf("verify: read balances: %w", err)
		}
	}
	for id, l := range byEvent {
		r.LedgerRows += l.n
		switch {
		case l.n > 1:
			r.Doubled++
		case l.lo != want[id] || l.hi != want[id]:
			r.WrongAmount++
		default:
			r.ExactlyOnce++
		}
	}
	r.Missing = len(m.Events) - len(byEvent)
	r.Strays = total - r.LedgerRows
	for u, w := range userWant {
		if got[u] != w {
			r.BalanceMismatch++
		}
	}
	return r, nil
}

// Wait checks until nothing is missing or timeout passes, then returns the
// last report. A doubled event cannot heal, so it returns at once on one.
func Wait(ctx context.Context, pool *pgxpool.Pool, m loadgen.Manifest, timeout time.Duration) (Report, error) {
	return WaitShards(ctx, []*pgxpool.Pool{pool}, m, timeout)
}

// WaitShards is Wait over shards (see CheckShards).
func WaitShards(ctx context.Context, pools []*pgxpool.Pool, m loadgen.Manifest, timeout time.Duration) (Report, error) {
	deadline := time.Now().Add(timeout)
	for {
		r, err := CheckShards(ctx, pools, m)
		if err != nil || r.Missing == 0 || r.Doubled > 0 || time.Now().After(deadline) {
			return r, err
		}
		select {
		case <-ctx.Done():
			return r, ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// Print writes r as a two-column table ending in a verdict line.
func (r Report) Print(w io.Writer) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	row := func(name string, v any) { fmt.Fprintf(tw, "%s\t%v\t\n", name, v) }
	fmt.Fprintf(w, "verification of run %s\n", r.RunID)
	row("messages published", r.Messages)
	row("distinct events", r.Distinct)
	row("ledger rows", r.LedgerRows)
	row("applied exactly once", r.ExactlyOnce)
	row("doubled", r.Doubled)
	row("missing", r.Missing)
	row("wrong amount", r.WrongAmount)
	row("stray rows", r.Strays)
	row("users", r.Users)
	row("balance mismatches", r.BalanceMismatch)
	if r.Shards > 1 {
		row("shards", r.Shards)
		row("misrouted rows", r.Misrouted)
	}
	_ = tw.Flush()
	if r.OK() {
		fmt.Fprintln(w, "PASS: every event applied exactly once, none missing, balances match")
	} else {
		fmt.Fprintln(w, "FAIL: doubled, missing, misrouted or mismatched effects (see above)")
	}
}
