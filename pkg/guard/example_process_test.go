package guard_test

import (
	"context"
	"errors"
	"fmt"
	"os"
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
		_, err := tx.Exec(ctx, `UPDATE account_balances SET balance = balance + 1000 WHERE user_id = 'user_42'`)
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
