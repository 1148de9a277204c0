package guard_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/guard/redistier"
)

// Wiring both tiers and guarding one payment. (Compiled, not run: it needs
// the services.)
func ExampleGuard_Process() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL")) // tables from `idem migrate`
	if err != nil {
		panic(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379", ContextTimeoutEnabled: true})
	fast, err := redistier.New(rdb, redistier.Config{Lease: 30 * time.Second, DoneTTL: 24 * time.Hour})
	if err != nil {
		panic(err)
	}
	g, err := guard.New(guard.Config{Scope: "billing", Store: pgtier.New(pool), Fast: fast})
	if err != nil {
		panic(err)
	}

	ev := guard.Event{ID: "evt_12345", Hash: guard.HashFields("evt_12345", "user_42", "1000")}
	outcome, err := g.Process(ctx, ev, func(ctx context.Context, tx pgx.Tx) error {
		// Every write goes through tx, which also holds the dedup row.
		_, err := tx.Exec(ctx, `UPDATE balances SET balance = balance + 1000 WHERE user_id = 'user_42'`)
		return err
	})
	switch {
	case err == nil:
		fmt.Println("ack:", outcome) // processed, duplicate_redis or duplicate_postgres
	case errors.Is(err, guard.ErrPayloadConflict):
		fmt.Println("dead-letter: same id, other payload")
	default:
		fmt.Println("retry: nothing was committed, or the commit's fate is unknown:", err)
	}
}

// Guarding a batch: one Redis pipeline, one transaction, the effect applied
// set-based for the new events only. (Compiled, not run: it needs the
// services.)
func ExampleGuard_ProcessBatch() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	g, err := guard.New(guard.Config{Scope: "billing", Store: pgtier.New(pool)})
	if err != nil {
		panic(err)
	}
	defer g.Flush(ctx) // the done markers of the last batch, if a fast tier is set

	type payment struct {
		id, user string
		amount   int64
	}
	payments := []payment{{"evt_1", "user_1", 500}, {"evt_2", "user_2", 700}, {"evt_1", "user_1", 500}}
	events := make([]guard.Event, len(payments))
	for i, p := range payments {
		events[i] = guard.Event{ID: p.id, Hash: guard.HashFields(p.id, p.user, fmt.Sprint(p.amount))}
	}
	results, err := g.ProcessBatch(ctx, events, func(ctx context.Context, tx pgx.Tx, claimed []int) error {
		users := make([]string, len(claimed))
		amounts := make([]int64, len(claimed))
		for k, i := range claimed {
			users[k], amounts[k] = payments[i].user, payments[i].amount
		}
		// Sum per user first: an UPDATE … FROM applies one matching row per
		// target row, so two payments of one user would count once.
		_, err := tx.Exec(ctx, `UPDATE balances AS b SET balance = b.balance + t.total
			FROM (SELECT user_id, sum(amount)::bigint AS total FROM unnest($1::text[], $2::bigint[]) AS u(user_id, amount)
			      GROUP BY user_id) AS t
			WHERE b.user_id = t.user_id`, users, amounts)
		return err
	})
	if err != nil {
		fmt.Println("retry the batch, or split it to find the event that fails:", err)
		return
	}
	for i, r := range results {
		fmt.Println(payments[i].id, r.Outcome) // evt_1 processed, evt_2 processed, evt_1 duplicate_batch
	}
}

// payment is the event of ExampleGuard_Process_service.
type payment struct {
	ID, User string
	Amount   int64
	At       time.Time // when the producer says it happened
}

// The README's "Using the guard in your own service": the lines between the
// docs markers are quoted there, and a test checks that they still are.
// (Compiled, not run: it needs the services.)
func ExampleGuard_Process_service() {
	ctx := context.Background()
	ev := payment{ID: "evt_12345", User: "user_42", Amount: 1000, At: time.Now()}
	// docs:begin
	pool, _ := pgxpool.New(ctx, os.Getenv("DATABASE_URL")) // migrations.Apply(ctx, pool) creates idem's tables only
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379", ContextTimeoutEnabled: true, MaxRetries: -1})
	fast, _ := redistier.New(rdb, redistier.Config{Lease: 30 * time.Second, DoneTTL: 24 * time.Hour})
	g, _ := guard.New(guard.Config{Scope: "billing", Store: pgtier.New(pool), Fast: fast})

	hash := guard.HashFields(ev.ID, ev.User, strconv.FormatInt(ev.Amount, 10))
	outcome, err := g.Process(ctx, guard.Event{ID: ev.ID, Hash: hash, Time: ev.At},
		func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `UPDATE accounts SET balance = balance + $1 WHERE id = $2`, ev.Amount, ev.User)
			return err // every write goes through tx, which also holds the dedup row
		})
	switch {
	case err == nil: // processed, or a duplicate (outcome says which): ack
	case errors.Is(err, guard.ErrPayloadConflict): // same ID, other payload: dead-letter
	case outcome == guard.OutcomeRefused: // outside the replay horizon (too old, too far ahead, untimed after a prune): dead-letter
	default: // nothing committed (or a commit of unknown fate): retry is safe
	}
	// docs:end
}
