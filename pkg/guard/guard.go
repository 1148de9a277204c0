package guard

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
)

// Step names a point in Process, between two steps of the flow. Hooks see each
// step as it completes; the crash tests kill the process there.
type Step string

const (
	StepFastClaimed  Step = "after_fast_claim"  // Redis SET NX answered (or was skipped)
	StepStoreClaimed Step = "after_store_claim" // dedup row inserted, tx open
	StepApplied      Step = "after_apply"       // handler returned, tx open
	StepCommitted    Step = "after_commit"      // dedup row and effect committed
	StepMarkedDone   Step = "after_mark_done"   // Redis done marker written (or failed)
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
	// Store is the authoritative tier. Required.
	Store Store
	// Fast is the optional fast tier. Nil means every event goes to Store.
	Fast FastPath
	// Hook, if set, is called after each Step. For tests and tracing.
	Hook func(ctx context.Context, step Step)
	// Logger receives fast-tier faults at debug level. Defaults to a
	// logger that discards.
	Logger *slog.Logger
}

// Guard runs handlers at most once per (scope, event ID), with the effect and
// the dedup row committed together. It is safe for concurrent use.
type Guard struct {
	scope string
	store Store
	fast  FastPath
	hook  func(context.Context, Step)
	log   *slog.Logger
}

// New returns a Guard, or an error naming the bad Config field.
func New(cfg Config) (*Guard, error) {
	if err := ValidateScope(cfg.Scope); err != nil {
		return nil, fmt.Errorf("guard: Scope: %w", err)
	}
	if cfg.Store == nil {
		return nil, errors.New("guard: Store is required")
	}
	g := &Guard{scope: cfg.Scope, store: cfg.Store, fast: cfg.Fast, hook: cfg.Hook, log: cfg.Logger}
	if g.hook == nil {
		g.hook = func(context.Context, Step) {}
	}
	if g.log == nil {
		g.log = slog.New(slog.DiscardHandler)
	}
	return g, nil
}

// Scope returns the scope the guard namespaces event IDs by.
func (g *Guard) Scope() string { return g.scope }

// Process runs apply for ev unless ev was already processed.
//
// It returns OutcomeProcessed after apply's effect committed,
// OutcomeDuplicateRedis or OutcomeDuplicatePostgres if the event was processed
// before, and OutcomePayloadConflict with ErrPayloadConflict if the ID was
// processed before with another payload. Any other error means nothing was
// committed by this call, or (for a *StoreError from commit) that the outcome
// is unknown: in both cases running Process again is safe and decides it.
func (g *Guard) Process(ctx context.Context, ev Event, apply ApplyFunc) (Outcome, error) {
	if err := ev.validate(); err != nil {
		return OutcomeUnknown, err
	}
	events := []Event{ev}

	var lease *Lease
	if g.fast != nil {
		r := g.fast.Claim(ctx, g.scope, events)[0]
		g.hook(ctx, StepFastClaimed)
		switch r.State {
		case FastDone:
			if bytes.Equal(r.Hash, ev.Hash) {
				return OutcomeDuplicateRedis, nil
			}
			// Another payload under the same ID: let the store decide, it
			// holds the hash of record.
		case FastAcquired:
			lease = &Lease{ID: ev.ID, Token: r.Token}
		case FastSkipped:
			if r.Err != nil {
				g.log.DebugContext(ctx, "fast tier skipped", "event_id", ev.ID, "err", r.Err)
			}
		}
	}

	outcome, err := g.processInStore(ctx, events, apply)
	switch {
	case err == nil:
		// The row is committed, by us or before us: done is now true.
		if g.fast != nil {
			if err := g.fast.MarkDone(ctx, g.scope, events); err != nil {
				g.log.DebugContext(ctx, "mark done", "event_id", ev.ID, "err", err)
			}
			g.hook(ctx, StepMarkedDone)
		}
	case lease != nil:
		g.release(ctx, *lease)
	}
	return outcome, err
}

// processInStore is steps 3 to 5: claim the dedup row, apply, commit.
func (g *Guard) processInStore(ctx context.Context, events []Event, apply ApplyFunc) (Outcome, error) {
	tx, err := g.store.Begin(ctx)
	if err != nil {
		return OutcomeUnknown, &StoreError{Op: "begin", Err: err}
	}
	defer rollback(ctx, tx)

	res, err := g.store.Claim(ctx, tx, g.scope, events)
	if err != nil {
		return OutcomeUnknown, &StoreError{Op: "claim", Err: err}
	}
	switch res[0] {
	case ClaimDuplicate:
		return OutcomeDuplicatePostgres, nil
	case ClaimConflict:
		return OutcomePayloadConflict, ErrPayloadConflict
	}
	g.hook(ctx, StepStoreClaimed)

	if err := apply(ctx, tx); err != nil {
		return OutcomeUnknown, &HandlerError{Err: err}
	}
	g.hook(ctx, StepApplied)

	if err := tx.Commit(ctx); err != nil {
		return OutcomeUnknown, &StoreError{Op: "commit", Err: err}
	}
	g.hook(ctx, StepCommitted)
	return OutcomeProcessed, nil
}

func (g *Guard) release(ctx context.Context, l Lease) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	if err := g.fast.Release(ctx, g.scope, []Lease{l}); err != nil {
		g.log.DebugContext(ctx, "release lease", "event_id", l.ID, "err", err)
	}
}

// rollback ends tx if it is still open. After Commit it is a no-op.
func rollback(ctx context.Context, tx pgx.Tx) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	_ = tx.Rollback(ctx) // pgx.ErrTxClosed after commit; a dead conn rolls back by itself
}
