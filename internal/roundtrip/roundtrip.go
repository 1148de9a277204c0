// Package roundtrip counts round trips to Postgres and Redis, for the
// measurements of idem-lab lab and idem-lab bench: a pgx tracer and a go-redis hook
// that add one to a counter per trip, and a pgx tracer that also times each
// trip and files it under its cause (ByCause).
package roundtrip

import (
	"context"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
)

// Postgres returns a pgx tracer that adds one to n for every statement
// (BEGIN and COMMIT included) and every batch, which pgx sends in one round
// trip.
func Postgres(n *atomic.Int64) pgx.QueryTracer { return pgTrips{n} }

// Redis returns a go-redis hook that adds one to n for every command and
// every pipeline.
func Redis(n *atomic.Int64) redis.Hook { return redisTrips{n} }

type pgTrips struct{ n *atomic.Int64 }

var _ pgx.BatchTracer = pgTrips{}

func (t pgTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	t.n.Add(1)
	return ctx
}
func (pgTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (t pgTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	t.n.Add(1)
	return ctx
}
func (pgTrips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (pgTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

type redisTrips struct{ n *atomic.Int64 }

func (redisTrips) DialHook(next redis.DialHook) redis.DialHook { return next }
func (t redisTrips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		t.n.Add(1)
		return next(ctx, cmd)
	}
}
func (t redisTrips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		t.n.Add(1)
		return next(ctx, cmds)
	}
}
