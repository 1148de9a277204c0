package guard

import (
	"context"
	"time"
)

// Stage names a piece of work the guard times for its Observer.
type Stage string

const (
	StageFastClaim  Stage = "fast_claim"  // the fast tier's claim pipeline for a batch
	StageHistory    Stage = "history"     // the store's history, read alone to confirm done markers
	StageStoreClaim Stage = "store_claim" // BEGIN and the dedup rows' claim
	StageApply      Stage = "apply"       // the handler, inside the transaction
	StageCommit     Stage = "commit"      // COMMIT of rows and effects
	StageMarkDone   Stage = "mark_done"   // done markers written to the fast tier
	StageRelease    Stage = "release"     // leases handed back to the fast tier
)

// Stages lists every Stage, for metrics that want a series for each.
func Stages() []Stage {
	return []Stage{StageFastClaim, StageHistory, StageStoreClaim, StageApply, StageCommit, StageMarkDone, StageRelease}
}

// Observer sees the guard's work as it happens: for metrics and tracing. It
// is called on the events' path, so it must be fast and safe for concurrent
// use. Package metrics has a Prometheus implementation.
type Observer interface {
	// ObserveStage is called once each time a stage ran, for a batch of
	// events (one, for Process), with how long it took and its error: nil
	// on success. For StageFastClaim the error is the first fault of the
	// fast tier's answers; such faults never fail an event.
	ObserveStage(ctx context.Context, stage Stage, events int, took time.Duration, err error)
	// CrossShardConflict is called for an event the store processed
	// although the fast tier held a done marker for its ID with another
	// payload's hash: the ID was processed before with another payload,
	// where this event's store could not see it. With Config.Shards that is
	// a conflict between two events that share an ID but not a shard; with
	// one store, a dedup row pruned while its marker lived. The fast tier
	// remembers IDs only for its done TTL, so this counts the conflicts it
	// can see, not all.
	CrossShardConflict(ctx context.Context, ev Event)
}

type nopObserver struct{}

func (nopObserver) ObserveStage(context.Context, Stage, int, time.Duration, error) {}
func (nopObserver) CrossShardConflict(context.Context, Event)                      {}
