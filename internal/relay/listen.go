package relay

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/internal/pgsession"
)

// listen wakes the relay on every idem_outbox notification, on a
// connection of its own, until ctx ends, and once each time it is
// listening: the round that wake starts reads what was committed before,
// while nobody listened (at start, or while this reconnected). It is only
// a hint: the relay polls too.
func listen(ctx context.Context, db *pgxpool.Pool, wake chan<- struct{}, log *slog.Logger) {
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		// A transaction-mode pooler lends the LISTENing session to other
		// clients between statements: its notifications would reach them,
		// not this connection. Polling carries the relay alone there.
		if pooled, err := pgsession.PoolIsPooled(ctx, db); err == nil && pooled {
			log.Info("outbox: PostgreSQL is reached through a transaction-mode pooler, which LISTEN cannot pass: the relay polls (outbox.poll_interval)")
			return
		}
		err := listenOnce(ctx, db, wake)
		if ctx.Err() != nil {
			return
		}
		log.Debug("outbox listener lost; polling until it is back", "err", err)
		sleep(ctx, jitter(backoff))
		backoff = min(2*backoff, 10*time.Second)
	}
}

func listenOnce(ctx context.Context, db *pgxpool.Pool, wake chan<- struct{}) error {
	c, err := db.Acquire(ctx)
	if err != nil {
		return err
	}
	conn := c.Hijack() // a LISTENing connection must not go back to the pool
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN idem_outbox"); err != nil {
		return err
	}
	for {
		select { // once listening, then on every notification
		case wake <- struct{}{}:
		default:
		}
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return err
		}
	}
}
