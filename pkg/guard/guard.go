package guard

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/partition"
)

// cleanupTimeout bounds rollbacks and lease releases, which run even when the
// caller's context has ended.
const cleanupTimeout = 2 * time.Second

// ApplyFunc performs an event's effect inside tx. It must not commit or roll
// back tx, and must do all its writes through tx.
type ApplyFunc func(ctx context.Context, tx pgx.Tx) error

// Config configures a Guard.
type Config struct {
	// Scope namespaces event IDs, normally the consuming service's name, so
	// that two services can each process the same event once. Required.
	Scope string
	// Store is the authoritative tier. Required, unless Shards is set.
	Store Store
	// Shards, instead of Store, splits the authoritative tier over several
	// databases: an event's dedup row goes to
	// Shards[partition.Of(ev.ShardKey, len(Shards))], the shard that
	// also holds its effects, so the row and the effect still commit in one
	// transaction. The order is part of the data layout: changing it, or
	// the number of shards, routes keys away from their history. A payload
	// conflict between two events that share an ID but not a shard cannot
	// be seen.
	Shards []Store
	// Fast is the optional fast tier. Nil means every event goes to Store.
	Fast FastPath
	// Observer, if set, sees how long each Stage took and how it ended.
	Observer Observer
	// Logger receives fast-tier faults at debug level, and a change of a
	// store's history at info. Defaults to a logger that discards.
	Logger *slog.Logger
}

// Guard commits an event's effect at most once per (scope, event ID): the
// effect and the dedup row commit together, in one transaction. The apply
// function itself may run more than once for an event (a transaction that
// rolled back, a retry, two consumers racing), but only one of its runs
// commits. It is safe for concurrent use.
type Guard struct {
	scope  string
	stores []Store // one, or one per shard
	fast   FastPath
	obs    Observer
	log    *slog.Logger

	markers   *markerWriter
	histories []*shardHistory // by shard
}

// New returns a Guard, or an error naming the bad Config field.
func New(cfg Config) (*Guard, error) {
	if err := ValidateScope(cfg.Scope); err != nil {
		return nil, fmt.Errorf("guard: Scope: %w", err)
	}
	stores := cfg.Shards
	switch {
	case cfg.Store != nil && len(cfg.Shards) > 0:
		return nil, errors.New("guard: set Store or Shards, not both")
	case cfg.Store != nil:
		stores = []Store{cfg.Store}
	case len(cfg.Shards) == 0:
		return nil, errors.New("guard: Store is required")
	case slices.Contains(cfg.Shards, nil):
		return nil, errors.New("guard: Shards holds a nil Store")
	}
	g := &Guard{scope: cfg.Scope, stores: stores, fast: cfg.Fast, obs: cfg.Observer, log: cfg.Logger}
	if g.obs == nil {
		g.obs = nopObserver{}
	}
	if g.log == nil {
		g.log = slog.New(slog.DiscardHandler)
	}
	g.markers = &markerWriter{fast: g.fast, scope: g.scope, obs: g.obs, log: g.log}
	g.histories = newShardHistories(len(stores))
	return g, nil
}

// Scope returns the scope the guard namespaces event IDs by.
func (g *Guard) Scope() string { return g.scope }

// Shards returns how many shards the authoritative tier has (1 without
// Config.Shards).
func (g *Guard) Shards() int { return len(g.stores) }

// Shard returns the index of the shard that holds ev's dedup row. A batch
// (ProcessBatch, Screen) must keep to one shard: group events by Shard
// first.
func (g *Guard) Shard(ev Event) int { return partition.Of(ev.ShardKey, len(g.stores)) }

// Process runs apply for ev unless ev was already processed.
//
// It returns OutcomeProcessed after apply's effect committed,
// OutcomeDuplicateRedis or OutcomeDuplicatePostgres if the event was processed
// before, and OutcomePayloadConflict with ErrPayloadConflict if the ID was
// processed before with another payload. Any other error means nothing was
// committed by this call, or (for a *StoreError from commit) that the outcome
// is unknown: in both cases running Process again is safe and decides it.
func (g *Guard) Process(ctx context.Context, ev Event, apply ApplyFunc) (Outcome, error) {
	res, err := g.ProcessBatch(ctx, []Event{ev}, func(ctx context.Context, tx pgx.Tx, _ []int) error {
		return apply(ctx, tx)
	})
	if err != nil {
		return OutcomeUnknown, err
	}
	return res[0].Outcome, res[0].Err
}

// Flush waits until the done markers of every event processed so far have
// been written to the fast tier, or have failed to be. Markers are written
// after the commit, off the caller's path; call Flush before shutting down so
// that the next process finds them, and in tests.
func (g *Guard) Flush(ctx context.Context) error { return g.markers.flush(ctx) }

// release drops leases this call still holds, so that a retry does not wait
// for them to expire.
func (g *Guard) release(ctx context.Context, leases []tier.Lease) {
	if len(leases) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	began := time.Now()
	err := g.fast.Release(ctx, g.scope, leases)
	g.obs.ObserveStage(ctx, StageRelease, len(leases), time.Since(began), err)
	if err != nil {
		g.log.DebugContext(ctx, "release leases", "leases", len(leases), "err", err)
	}
}

// rollback ends tx if it is still open. After Commit it is a no-op.
func rollback(ctx context.Context, tx pgx.Tx) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	_ = tx.Rollback(ctx) // pgx.ErrTxClosed after commit; a dead conn rolls back by itself
}
