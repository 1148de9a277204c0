package lab

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/step"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/guard/redistier"
)

// The two crash points every approach passes: after its duplicate check or
// claim, before the effect commits; and after the effect commits, before
// whatever marks the event done and before the ack.
const (
	AfterCheck  = "after_check"
	AfterEffect = "after_effect"
)

// Approach is one way to process events from an at-least-once broker. Handle
// returns "applied" or "duplicate"; an error sends the message back to the
// queue for another try, as the people who build it would.
type Approach interface {
	Handle(ctx context.Context, ev payments.Event) (string, error)
}

// Approaches names every approach in the order the comparison prints them.
var Approaches = []string{"table-check", "redis-check-set", "pg-unique", "broker-only", "idem", "redis-claim-first",
	"publish-after-commit", "publish-before-commit", "outbox"}

// Titles says in a few words what each approach is.
var Titles = map[string]string{
	"table-check":       "1. processed-events table checked before processing (no constraint)",
	"redis-check-set":   "2. Redis with a TTL: check, process, then set the key",
	"pg-unique":         "3. unique constraint in the effect's transaction (Postgres only)",
	"broker-only":       "4. rely on the broker: at-least-once, no dedup",
	"idem":              "5. Redis + database: idem's two-tier guard",
	"redis-claim-first": "+. Redis SET NX claim before processing, no database",

	"publish-after-commit":  "d1. idem, then a message to another service published after the commit",
	"publish-before-commit": "d2. idem, with the message published inside the transaction, before the commit",
	"outbox":                "d3. idem, with the message enqueued in the transaction (outbox) and relayed",
}

// deps is what an approach may use.
type deps struct {
	pool  *pgxpool.Pool
	rdb   *redis.Client
	ttl   time.Duration // Redis key TTL for the Redis approaches
	crash func(step string)
	log   *slog.Logger
	conn  *amqp.Connection // the worker's broker connection
	queue string           // the pass's work queue
}

func newApproach(name string, d deps) (Approach, error) {
	switch name {
	case "table-check":
		return tableCheck{d}, nil
	case "redis-check-set":
		return redisCheckSet{d}, nil
	case "pg-unique":
		return pgUnique{d}, nil
	case "broker-only":
		return brokerOnly{d}, nil
	case "idem":
		return newIdem(d)
	case "redis-claim-first":
		return claimFirst{d}, nil
	case "publish-after-commit", "publish-before-commit", "outbox":
		return newDownstream(name, d)
	}
	return nil, fmt.Errorf("unknown approach %q (want one of %v)", name, Approaches)
}

// applyInTx runs the payment's effect, and extra statements, in one
// transaction.
func (d deps) applyInTx(ctx context.Context, ev payments.Event, extra func(pgx.Tx) error) error {
	return pgx.BeginFunc(ctx, d.pool, func(tx pgx.Tx) error {
		if err := (payments.Handler{}).Apply(ctx, tx, ev); err != nil {
			return err
		}
		if extra != nil {
			return extra(tx)
		}
		return nil
	})
}

func (d deps) key(ev payments.Event) string { return "lab:" + ev.EventID }

// 1. Look the event up in a processed-events table; if absent, apply the
// effect and record the event in the same transaction. Nothing stops two
// consumers that both looked before either committed.
type tableCheck struct{ deps }

func (a tableCheck) Handle(ctx context.Context, ev payments.Event) (string, error) {
	var seen bool
	if err := a.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM lab_seen WHERE event_id = $1)`, ev.EventID).Scan(&seen); err != nil {
		return "", err
	}
	if seen {
		return "duplicate", nil
	}
	a.crash(AfterCheck)
	err := a.applyInTx(ctx, ev, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO lab_seen (event_id) VALUES ($1)`, ev.EventID)
		return err
	})
	if err != nil {
		return "", err
	}
	a.crash(AfterEffect)
	return "applied", nil
}

// 2. Check Redis, process, set the Redis key with a TTL. A Redis error
// requeues the message (failing open would double on purpose); a failed SET
// after the commit is logged, since the effect is done.
type redisCheckSet struct{ deps }

func (a redisCheckSet) Handle(ctx context.Context, ev payments.Event) (string, error) {
	n, err := a.rdb.Exists(ctx, a.key(ev)).Result()
	if err != nil {
		return "", err
	}
	if n > 0 {
		return "duplicate", nil
	}
	a.crash(AfterCheck)
	if err := a.applyInTx(ctx, ev, nil); err != nil {
		return "", err
	}
	a.crash(AfterEffect)
	if err := a.rdb.Set(ctx, a.key(ev), 1, a.ttl).Err(); err != nil {
		a.log.Warn("set processed key", "event", ev.EventID, "err", err)
	}
	return "applied", nil
}

// 3. Insert the event into a table with a primary key, in the effect's own
// transaction; a conflict means it was processed and the transaction is
// rolled back. The database decides every race.
type pgUnique struct{ deps }

func (a pgUnique) Handle(ctx context.Context, ev payments.Event) (string, error) {
	out := "applied"
	err := pgx.BeginFunc(ctx, a.pool, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `INSERT INTO lab_processed (event_id) VALUES ($1) ON CONFLICT DO NOTHING`, ev.EventID)
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 0 {
			out = "duplicate"
			return errDuplicate // roll back
		}
		a.crash(AfterCheck)
		return (payments.Handler{}).Apply(ctx, tx, ev)
	})
	if errors.Is(err, errDuplicate) {
		return out, nil
	}
	if err != nil {
		return "", err
	}
	a.crash(AfterEffect)
	return out, nil
}

var errDuplicate = errors.New("duplicate")

// 4. Apply every delivery: what the broker alone gives.
type brokerOnly struct{ deps }

func (a brokerOnly) Handle(ctx context.Context, ev payments.Event) (string, error) {
	a.crash(AfterCheck)
	if err := a.applyInTx(ctx, ev, nil); err != nil {
		return "", err
	}
	a.crash(AfterEffect)
	return "applied", nil
}

// 5. idem's guard: the Redis fast path behind a breaker, and the unique row
// in the effect's transaction.
type idemGuard struct {
	deps
	g *guard.Guard
}

func newIdem(d deps) (Approach, error) {
	// Every other setting at its default, as `idem consume` ships.
	fast, err := redistier.New(d.rdb, redistier.Config{Prefix: "lab", DoneTTL: d.ttl})
	if err != nil {
		return nil, err
	}
	// One guard per worker process: the process-wide hook is its own.
	step.SetHook(func(_ context.Context, s string) {
		switch s {
		case step.FastClaimed:
			d.crash(AfterCheck)
		case step.Committed:
			d.crash(AfterEffect)
		}
	})
	g, err := guard.New(guard.Config{Scope: "lab", Store: pgtier.New(d.pool), Fast: fast, Logger: d.log})
	if err != nil {
		return nil, err
	}
	return idemGuard{d, g}, nil
}

func (a idemGuard) Handle(ctx context.Context, ev payments.Event) (string, error) {
	o, err := a.g.Process(ctx, guard.Event{ID: ev.EventID, Hash: ev.Hash()}, func(ctx context.Context, tx pgx.Tx) error {
		return (payments.Handler{}).Apply(ctx, tx, ev)
	})
	switch {
	case err != nil:
		return "", err
	case o.IsDuplicate():
		return "duplicate", nil
	}
	return "applied", nil
}

// +. Claim the event in Redis with SET NX before processing; a claim that
// exists means a duplicate. Nothing releases a claim whose processing died.
type claimFirst struct{ deps }

func (a claimFirst) Handle(ctx context.Context, ev payments.Event) (string, error) {
	ok, err := a.rdb.SetNX(ctx, a.key(ev), 1, a.ttl).Result()
	if err != nil {
		return "", err
	}
	if !ok {
		return "duplicate", nil
	}
	a.crash(AfterCheck)
	if err := a.applyInTx(ctx, ev, nil); err != nil {
		return "", err
	}
	a.crash(AfterEffect)
	return "applied", nil
}
