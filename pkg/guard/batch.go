package guard

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/internal/step"
	"github.com/idemhq/idem/internal/tier"
)

// Result is one event's outcome in ProcessBatch.
type Result struct {
	Outcome Outcome
	// Err is ErrPayloadConflict when Outcome is OutcomePayloadConflict,
	// why the store refused the event when Outcome is OutcomeRefused, nil
	// otherwise.
	Err error
}

// BatchApplyFunc performs, inside tx, the effects of the events at the
// indexes in claimed (ascending): the events of the batch that are new. It
// must not commit or roll back tx, and should take its locks in a fixed order
// (sorted keys), so that two batches running at once cannot deadlock.
type BatchApplyFunc func(ctx context.Context, tx pgx.Tx, claimed []int) error

// ProcessBatch is Process for many events at once: one fast-tier pipeline
// for the batch, then one transaction that claims the dedup rows of the
// events the fast tier did not settle (in event ID order, so that two batches
// never deadlock on each other's rows), runs apply once for the new ones,
// and commits. Done markers are written after the commit, off the caller's
// path. It is Screen followed by Decide.
//
// On success every event has its Result. Two copies of one ID in the batch
// are one event: the later copy is OutcomeDuplicateBatch once the first
// commits, or OutcomePayloadConflict if its payload differs. On error no
// Result is final and nothing of the batch was committed (or, for a
// *StoreError from commit, the outcome is unknown): running the batch again,
// whole or split, is safe and decides it. An error that is not a *StoreError says apply failed
// for the batch as a whole; split the batch to find the event that fails.
func (g *Guard) ProcessBatch(ctx context.Context, events []Event, apply BatchApplyFunc) ([]Result, error) {
	b, err := g.Screen(ctx, events)
	if err != nil {
		return nil, err
	}
	return g.Decide(ctx, b, apply)
}

// Batch is a batch of events the fast tier has screened: ProcessBatch
// between its two halves.
type Batch struct {
	events  []Event
	first   []int // first[i]: the index of the first copy of events[i]'s ID
	res     []Result
	toStore []int              // events the fast tier did not settle
	leases  map[int]tier.Lease // the leases Screen took, by event index
	leased  []int              // events another holder had a lease on
	shard   int                // the shard every event maps to
	// doneElsewhere marks events whose ID the fast tier knows as done
	// with another payload.
	doneElsewhere map[int]bool
}

// Leased returns the indexes of the events whose ID another consumer holds a
// lease on: it is most likely processing them right now. Decide sends them
// to the store, where their claim waits for that consumer's transaction; a
// caller may Defer them instead and screen them again a moment later, when
// the fast tier will likely know them as done.
func (b *Batch) Leased() []int { return b.leased }

// Defer takes the events at idx out of the batch, with every copy of their
// IDs: Decide leaves them without a Result, and the caller must screen them
// again (in a later batch) to reach their outcome. Only events Leased
// reports may be deferred: Screen took no lease on them.
func (b *Batch) Defer(idx []int) {
	out := map[string]bool{}
	for _, i := range idx {
		out[b.events[i].ID] = true
	}
	b.toStore = slices.DeleteFunc(b.toStore, func(i int) bool { return out[b.events[i].ID] })
	b.leased = slices.DeleteFunc(b.leased, func(i int) bool { return out[b.events[i].ID] })
}

// Screened returns the indexes of the events the fast tier settled as
// duplicates (OutcomeDuplicateRedis). Their outcome is final and durable:
// they may be acked at once, before Decide.
func (b *Batch) Screened() []int {
	var out []int
	for i, r := range b.res {
		if r.Outcome == OutcomeDuplicateRedis {
			out = append(out, i)
		}
	}
	return out
}

// Screen is ProcessBatch's first half: it validates events and asks the fast
// tier about each distinct ID, in one pipeline, taking a lease on the new
// ones. Call Decide next, always: it releases the leases when it fails.
func (g *Guard) Screen(ctx context.Context, events []Event) (*Batch, error) {
	for _, ev := range events {
		if err := ev.Validate(); err != nil {
			return nil, err
		}
	}
	b := &Batch{events: events, first: make([]int, len(events)), res: make([]Result, len(events)), leases: map[int]tier.Lease{}}
	if len(events) > 0 {
		b.shard = g.Shard(events[0])
		for _, ev := range events[1:] {
			if s := g.Shard(ev); s != b.shard {
				return nil, fmt.Errorf("guard: %w: %q is on shard %d, %q on shard %d", ErrMixedShards, events[0].ID, b.shard, ev.ID, s)
			}
		}
	}
	seen := make(map[string]int, len(events))
	for i, ev := range events {
		j, ok := seen[ev.ID]
		if !ok {
			seen[ev.ID], j = i, i
		}
		b.first[i] = j
	}
	if g.fast == nil {
		b.toStore = make([]int, len(events))
		for i := range events {
			b.toStore[i] = i
		}
		return b, nil
	}
	var uniq []int
	var fastEvents []Event
	for i, ev := range events {
		if b.first[i] == i {
			uniq = append(uniq, i)
			fastEvents = append(fastEvents, ev)
		}
	}
	began := time.Now()
	answers := g.fast.Claim(ctx, g.scope, fastEvents)
	g.obs.ObserveStage(ctx, StageFastClaim, len(fastEvents), time.Since(began), firstFault(answers))
	byIndex := make(map[int]tier.FastResult, len(uniq))
	for k, i := range uniq {
		a := answers[k]
		byIndex[i] = a
		switch {
		case a.State == tier.FastAcquired:
			b.leases[i] = tier.Lease{ID: events[i].ID, Token: a.Token}
		case a.State == tier.FastSkipped && a.Err != nil && k == 0:
			g.log.DebugContext(ctx, "fast tier skipped", "event_id", events[i].ID, "events", len(uniq), "err", a.Err)
		}
		step.Reached(ctx, step.FastClaimed)
	}
	for i, ev := range events {
		a := byIndex[b.first[i]]
		if a.State == tier.FastDone && bytes.Equal(a.Hash, ev.Hash) {
			b.res[i] = Result{Outcome: OutcomeDuplicateRedis}
			continue
		}
		if a.State == tier.FastPending {
			b.leased = append(b.leased, i)
		}
		if a.State == tier.FastDone {
			if b.doneElsewhere == nil {
				b.doneElsewhere = map[int]bool{}
			}
			b.doneElsewhere[i] = true
		}
		// Not known to be done (a pending lease never drops an event,
		// ours or another's), or done with another payload: the
		// store holds the hash of record and decides.
		b.toStore = append(b.toStore, i)
	}
	return b, nil
}

// Decide is ProcessBatch's second half: one transaction for the events
// Screen did not settle and the caller did not Defer. Its results and errors
// are ProcessBatch's; a deferred event's Result is the zero Result.
func (g *Guard) Decide(ctx context.Context, b *Batch, apply BatchApplyFunc) ([]Result, error) {
	if len(b.toStore) == 0 {
		return b.res, nil
	}
	if err := g.processInStore(ctx, b.shard, b.events, b.toStore, b.res, apply); err != nil {
		g.release(ctx, leaseList(b.leases))
		return nil, err
	}
	var release []tier.Lease
	var done []Event
	for _, i := range b.toStore {
		if b.first[i] != i {
			continue
		}
		if b.res[i].Outcome == OutcomeProcessed && b.doneElsewhere[i] {
			g.obs.CrossShardConflict(ctx, b.events[i])
			g.log.WarnContext(ctx, "payload conflict the store could not see: the fast tier knew this ID as processed with another payload (on another shard, or before its row was pruned); processed here",
				"event_id", b.events[i].ID, "shard", b.shard)
		}
		switch b.res[i].Outcome {
		case OutcomeProcessed, OutcomeDuplicatePostgres:
			// The row is committed, by us or before us: done is now true.
			// The marker replaces our lease, if we hold one.
			done = append(done, b.events[i])
		default:
			if l, ok := b.leases[i]; ok {
				release = append(release, l)
			}
		}
	}
	g.release(ctx, release)
	if g.fast != nil && len(done) > 0 {
		g.markers.add(done)
	}
	return b.res, nil
}

// processInStore is steps 3 to 5 for the events at idx: claim their dedup
// rows, apply the new ones, commit. It fills in their results. Only the first
// copy of an ID goes to the store; later copies take their outcome from it.
func (g *Guard) processInStore(ctx context.Context, shard int, events []Event, idx []int, res []Result, apply BatchApplyFunc) error {
	reps, copies, rep := firstCopies(events, idx)
	store := g.stores[shard]
	named := shard
	if len(g.stores) == 1 {
		named = -1
	}
	storeErr := func(op StoreOp, err error) *StoreError { return &StoreError{Op: op, Err: err, Shard: named} }
	began := time.Now()
	tx, err := store.Begin(ctx)
	if err != nil {
		err = storeErr(StoreBegin, err)
		g.obs.ObserveStage(ctx, StageStoreClaim, len(reps), time.Since(began), err)
		return err
	}
	defer rollback(ctx, tx)

	claims, err := g.claim(ctx, store, tx, events, reps)
	if err != nil {
		err = storeErr(StoreClaim, err)
	}
	g.obs.ObserveStage(ctx, StageStoreClaim, len(reps), time.Since(began), err)
	if err != nil {
		return err
	}
	var claimed []int
	for _, i := range reps {
		res[i] = claimResult(claims[i])
		if claims[i] == tier.ClaimInserted {
			claimed = append(claimed, i)
		}
	}
	if unknown := copyResults(events, copies, rep, claims, res); len(unknown) > 0 {
		more, err := g.claim(ctx, store, tx, events, unknown)
		if err != nil {
			return storeErr(StoreClaim, err)
		}
		for _, i := range unknown {
			res[i] = claimResult(more[i])
		}
	}
	if len(claimed) == 0 {
		return nil // nothing to apply or commit; the deferred rollback ends tx
	}
	slices.Sort(claimed)
	if err := g.applyAndCommit(ctx, tx, events, claimed, apply, named); err != nil {
		return err
	}
	for _, i := range claimed {
		res[i] = Result{Outcome: OutcomeProcessed}
		step.Reached(ctx, step.Committed)
	}
	for _, i := range copies {
		if res[i].Outcome == OutcomeDuplicateBatch {
			step.Reached(ctx, step.Committed) // its first copy's row committed
		}
	}
	return nil
}

// firstCopies splits the events at idx into the first copy of each ID
// (reps, which go to the store) and the later copies, and maps each ID to
// its first copy.
func firstCopies(events []Event, idx []int) (reps, copies []int, rep map[string]int) {
	rep = make(map[string]int, len(idx))
	for _, i := range idx {
		if _, ok := rep[events[i].ID]; ok {
			copies = append(copies, i)
			continue
		}
		rep[events[i].ID] = i
		reps = append(reps, i)
	}
	return reps, copies, rep
}

// copyResults fills in the results of later copies from their first copy's
// claim, and returns those it cannot tell: two payloads, neither the row's,
// for which the store must be asked.
func copyResults(events []Event, copies []int, rep map[string]int, claims map[int]tier.ClaimResult, res []Result) (unknown []int) {
	for _, i := range copies {
		r := rep[events[i].ID]
		same := bytes.Equal(events[i].Hash, events[r].Hash)
		switch {
		case claims[r].Refused():
			res[i] = claimResult(claims[r]) // no row to compare with: refused alike
		case claims[r] == tier.ClaimInserted && same:
			res[i] = Result{Outcome: OutcomeDuplicateBatch}
		case claims[r] == tier.ClaimDuplicate && same:
			res[i] = Result{Outcome: OutcomeDuplicatePostgres}
		case claims[r] != tier.ClaimConflict || same:
			// Either the row holds the first copy's hash and this copy
			// differs from it, or this copy shares the first copy's
			// hash, which the row does not hold.
			res[i] = Result{Outcome: OutcomePayloadConflict, Err: ErrPayloadConflict}
		default:
			unknown = append(unknown, i)
		}
	}
	return unknown
}

// applyAndCommit applies the claimed events in tx, which holds their new
// dedup rows, and commits: steps 4 and 5. shard names the store in a
// failed commit's error (-1: the only one).
func (g *Guard) applyAndCommit(ctx context.Context, tx pgx.Tx, events []Event, claimed []int, apply BatchApplyFunc, shard int) error {
	for range claimed {
		step.Reached(ctx, step.StoreClaimed)
	}
	ids := make([]string, len(claimed))
	for k, i := range claimed {
		ids[k] = events[i].ID
	}
	began := time.Now()
	err := apply(tier.WithApply(ctx, &tier.Apply{Scope: g.scope, IDs: ids}), tx, claimed)
	g.obs.ObserveStage(ctx, StageApply, len(claimed), time.Since(began), err)
	if err != nil {
		return fmt.Errorf("apply: %w", err)
	}
	for range claimed {
		step.Reached(ctx, step.Applied)
	}
	began = time.Now()
	err = tx.Commit(ctx)
	g.obs.ObserveStage(ctx, StageCommit, len(claimed), time.Since(began), err)
	if err != nil {
		return &StoreError{Op: StoreCommit, Err: err, Shard: shard}
	}
	return nil
}

// claim claims the dedup rows of the events at idx (distinct IDs) in event
// ID order, so that two batches lock shared rows in one order, and returns
// the store's answer by event index.
func (g *Guard) claim(ctx context.Context, store Store, tx pgx.Tx, events []Event, idx []int) (map[int]tier.ClaimResult, error) {
	order := slices.Clone(idx)
	slices.SortFunc(order, func(a, b int) int { return strings.Compare(events[a].ID, events[b].ID) })
	batch := make([]Event, len(order))
	for k, i := range order {
		batch[k] = events[i]
	}
	claims, err := store.Claim(ctx, tx, g.scope, batch)
	if err != nil {
		return nil, err
	}
	out := make(map[int]tier.ClaimResult, len(order))
	for k, i := range order {
		out[i] = claims[k]
	}
	return out, nil
}

// claimResult is the outcome a store answer gives an event, before commit.
func claimResult(c tier.ClaimResult) Result {
	switch c {
	case tier.ClaimDuplicate:
		return Result{Outcome: OutcomeDuplicatePostgres}
	case tier.ClaimConflict:
		return Result{Outcome: OutcomePayloadConflict, Err: ErrPayloadConflict}
	}
	if c.Refused() {
		return Result{Outcome: OutcomeRefused, Err: refusal(c)}
	}
	return Result{} // inserted: processed once it commits
}

// firstFault is the first fault among the fast tier's answers, or nil.
func firstFault(answers []tier.FastResult) error {
	for _, a := range answers {
		if a.Err != nil {
			return a.Err
		}
	}
	return nil
}

func leaseList(m map[int]tier.Lease) []tier.Lease {
	out := make([]tier.Lease, 0, len(m))
	for _, l := range m {
		out = append(out, l)
	}
	return out
}
