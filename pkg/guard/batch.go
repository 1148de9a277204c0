package guard

import (
	"bytes"
	"context"
	"errors"
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
	// marked holds the events the fast tier knows as done with their own
	// payload, by the history their marker names, until the store confirms
	// that history (settle): their outcome is not known before.
	marked map[int]tier.History
	// screened is when Screen began: the caller held every delivery of
	// the batch by then. A history the store reported in a statement sent
	// after it confirms the batch's markers (see shardHistory).
	screened time.Time
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
// they may be acked at once, before Decide. A done marker counts only once
// the store confirmed the history it names, in a statement sent after
// Screen began: Confirm does that for a batch that sends nothing else to the
// store; otherwise Decide does, in its claim, and its Results say. Right
// after Screen, none is settled yet.
func (b *Batch) Screened() []int {
	var out []int
	for i, r := range b.res {
		if r.Outcome == OutcomeDuplicateRedis {
			out = append(out, i)
		}
	}
	return out
}

// Unconfirmed returns the indexes of the events whose done markers wait for
// the store to confirm the history they name (Confirm, or Decide's claim).
func (b *Batch) Unconfirmed() []int {
	out := make([]int, 0, len(b.marked))
	for i := range b.marked {
		out = append(out, i)
	}
	slices.Sort(out)
	return out
}

// Screen is ProcessBatch's first half: it validates events and asks the fast
// tier about each distinct ID, in one pipeline, taking a lease on the new
// ones. It sends nothing to the store. Call Decide next, always (after
// Confirm, if the caller confirms first): it releases the leases when it
// fails.
//
// A done marker is trusted only in the history of the store it names, and
// only once the store reported that history in a statement sent after
// Screen began (see Screened): a marker from before a failover or a restore
// of the database never drops an event the database no longer holds.
func (g *Guard) Screen(ctx context.Context, events []Event) (*Batch, error) {
	screened := time.Now()
	for _, ev := range events {
		if err := ev.Validate(); err != nil {
			return nil, err
		}
	}
	b := &Batch{events: events, first: make([]int, len(events)), res: make([]Result, len(events)), leases: map[int]tier.Lease{}, screened: screened}
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
	answers := g.fast.Claim(ctx, g.scope, g.histories[b.shard].known(), fastEvents)
	g.obs.ObserveStage(ctx, StageFastClaim, len(fastEvents), time.Since(began), firstFault(answers))
	byIndex := make([]tier.FastResult, len(events)) // set at each first copy's index
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
	// An ID whose copies differ from its marker's hash goes to the store
	// whole, so that a marker the store does not confirm never splits
	// the copies of one ID over two claims.
	var mixed map[string]bool // nil, and so empty, in almost every batch
	for i, ev := range events {
		if a := &byIndex[b.first[i]]; a.State == tier.FastDone && !bytes.Equal(a.Hash, ev.Hash) {
			if mixed == nil {
				mixed = map[string]bool{}
			}
			mixed[ev.ID] = true
		}
	}
	for i, ev := range events {
		a := &byIndex[b.first[i]]
		if a.State == tier.FastDone && !mixed[ev.ID] {
			if b.marked == nil {
				b.marked = map[int]tier.History{}
			}
			b.marked[i] = a.History
			continue
		}
		if a.State == tier.FastPending {
			b.leased = append(b.leased, i)
		}
		if a.State == tier.FastDone && !bytes.Equal(a.Hash, ev.Hash) {
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
	if len(b.marked) > 0 {
		g.histories[b.shard].screenedMarked(len(b.marked))
	}
	return b, nil
}

// Confirm settles the done markers of b that the store confirms, in a read
// of its history sent after b was screened, as duplicates
// (OutcomeDuplicateRedis: see Screened), and sends the others to the store
// (Decide sends them). It is for a batch that sends nothing else to the
// store: one that does reads the history in its claim, at no cost of its
// own, and Decide confirms without it. Reads are shared by every batch of a
// shard, at most one in flight and one per historyGap or per 32 events
// screened with a marker (historyEnough), so a caller that
// confirms off its pipeline (the consumer does) pays latency, not a round
// trip per batch.
//
// A store that does not answer confirms nothing: Confirm returns its error
// (a *StoreError) and leaves b as it was, for the caller to hold the events
// and call Confirm again, or to Decide, which sends them to the store. Call
// Decide next, always, unless the caller hands the events back (Abandon).
func (g *Guard) Confirm(ctx context.Context, b *Batch) error {
	if len(b.marked) == 0 {
		return nil
	}
	h, err := g.readHistory(ctx, b)
	if err != nil {
		return &StoreError{Op: StoreHistory, Err: err, Shard: g.named(b.shard)}
	}
	g.settleLate(ctx, b, h)
	return nil
}

// Decide is ProcessBatch's second half: one transaction for the events
// Screen did not settle and the caller did not Defer. Its results and errors
// are ProcessBatch's; a deferred event's Result is the zero Result.
func (g *Guard) Decide(ctx context.Context, b *Batch, apply BatchApplyFunc) ([]Result, error) {
	if len(b.marked) > 0 && len(b.toStore) == 0 {
		g.confirm(ctx, b) // what else the batch had was deferred
	}
	if len(b.toStore) == 0 {
		return b.res, nil
	}
	history, err := g.processInStore(ctx, b, apply)
	if err != nil {
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
			// The marker replaces our lease, if we hold one. A store that
			// reported no history (pgtier.Options.NoMarkers) names none
			// for a marker to count in: it would never confirm, so the
			// lease goes instead.
			if history == "" {
				if l, ok := b.leases[i]; ok {
					release = append(release, l)
				}
				continue
			}
			done = append(done, b.events[i])
		default:
			if l, ok := b.leases[i]; ok {
				release = append(release, l)
			}
		}
	}
	g.release(ctx, release)
	if g.fast != nil && len(done) > 0 {
		g.markers.add(history, done)
	}
	return b.res, nil
}

// processInStore is steps 3 to 5 for the events of b.toStore: claim their
// dedup rows, apply the new ones, commit. It fills in their results, and
// returns the history the store reported in the claim: the one the rows
// committed in (or were found in). The claim also confirms b's marked
// events; those whose marker names another history join b.toStore. Only the
// first copy of an ID goes to the store; later copies take their outcome
// from it.
func (g *Guard) processInStore(ctx context.Context, b *Batch, apply BatchApplyFunc) (tier.History, error) {
	named := b.shard
	if len(g.stores) == 1 {
		named = -1
	}
	tx, claimed, history, err := g.beginClaim(ctx, b, named)
	if err != nil {
		return "", err
	}
	if late := g.settle(ctx, b, history); len(late) > 0 {
		// Their rows are claimed with the others, in one statement and a
		// new transaction: a second statement in this one would lock rows
		// out of ID order, and two batches could deadlock. Rare: once per
		// key after the database's history changed.
		rollback(ctx, tx)
		b.toStore = append(b.toStore, late...)
		slices.Sort(b.toStore)
		if tx, claimed, history, err = g.beginClaim(ctx, b, named); err != nil {
			return "", err
		}
	}
	defer rollback(ctx, tx)
	if len(claimed) == 0 {
		// Nothing to apply. Commit all the same: a claim that found rows
		// made its commit wait for the standbys that synchronous_commit
		// names (pgtier.Store.Claim), and only then may they be acked.
		began := time.Now()
		err := commit(ctx, tx)
		g.obs.ObserveStage(ctx, StageCommit, 0, time.Since(began), err)
		if err != nil {
			return "", &StoreError{Op: StoreCommit, Err: err, Shard: named}
		}
		return history, nil
	}
	slices.Sort(claimed)
	if err := g.applyAndCommit(ctx, tx, b.events, claimed, apply, named); err != nil {
		return "", err
	}
	for _, i := range claimed {
		b.res[i] = Result{Outcome: OutcomeProcessed}
		step.Reached(ctx, step.Committed)
	}
	for _, i := range b.toStore {
		if b.res[i].Outcome == OutcomeDuplicateBatch {
			step.Reached(ctx, step.Committed) // its first copy's row committed
		}
	}
	return history, nil
}

// beginClaim begins a transaction on b's store and claims the rows of
// b.toStore in it: step 3. It returns the transaction, open, the first
// copies whose rows it inserted, and the store's history. Its error is a
// *StoreError naming shard named; the transaction is then over.
func (g *Guard) beginClaim(ctx context.Context, b *Batch, named int) (pgx.Tx, []int, tier.History, error) {
	store := g.stores[b.shard]
	began := time.Now()
	tx, err := store.Begin(ctx)
	if err != nil {
		err = &StoreError{Op: StoreBegin, Err: err, Shard: named}
		g.obs.ObserveStage(ctx, StageStoreClaim, len(b.toStore), time.Since(began), err)
		return nil, nil, "", err
	}
	sent := time.Now() // the claim statement, which reads the history, leaves after it
	claimed, history, err := g.claimRows(ctx, store, tx, b, b.toStore)
	if err != nil {
		rollback(ctx, tx)
		err = &StoreError{Op: StoreClaim, Err: err, Shard: named}
	}
	g.obs.ObserveStage(ctx, StageStoreClaim, len(b.toStore), time.Since(began), err)
	if err != nil {
		return nil, nil, "", err
	}
	if history != "" {
		// A store may leave the history out of its claims
		// (pgtier.Options.NoMarkers): nothing to learn from "", and a read
		// waiting for an answer takes the store's History instead.
		sh := g.histories[b.shard]
		sh.saw(ctx, g.log, b.shard, history)
		sh.observe(sent, history)
	}
	return tx, claimed, history, nil
}

// claimRows claims, in tx, the dedup rows of the events at idx (every copy
// of each of their IDs) and fills in their results. It returns the first
// copies whose rows it inserted, which are to be applied, and the store's
// history.
func (g *Guard) claimRows(ctx context.Context, store Store, tx pgx.Tx, b *Batch, idx []int) ([]int, tier.History, error) {
	reps, copies, rep := firstCopies(b.events, idx)
	claims, history, err := g.claim(ctx, store, tx, b.events, reps)
	if err != nil {
		return nil, "", err
	}
	var claimed []int
	for _, i := range reps {
		b.res[i] = claimResult(claims[i])
		if claims[i] == tier.ClaimInserted {
			claimed = append(claimed, i)
		}
	}
	if unknown := copyResults(b.events, copies, rep, claims, b.res); len(unknown) > 0 {
		more, _, err := g.claim(ctx, store, tx, b.events, unknown)
		if err != nil {
			return nil, "", err
		}
		for _, i := range unknown {
			b.res[i] = claimResult(more[i])
		}
	}
	return claimed, history, nil
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
	var times []time.Time
	for k, i := range claimed {
		ids[k] = events[i].ID
		if t := events[i].Time; !t.IsZero() {
			if times == nil {
				times = make([]time.Time, len(claimed))
			}
			times[k] = t
		}
	}
	began := time.Now()
	err := apply(tier.WithApply(ctx, &tier.Apply{Scope: g.scope, IDs: ids, Times: times}), tx, claimed)
	g.obs.ObserveStage(ctx, StageApply, len(claimed), time.Since(began), err)
	if err != nil {
		return fmt.Errorf("apply: %w", err)
	}
	for range claimed {
		step.Reached(ctx, step.Applied)
	}
	began = time.Now()
	err = commit(ctx, tx)
	g.obs.ObserveStage(ctx, StageCommit, len(claimed), time.Since(began), err)
	if err != nil {
		return &StoreError{Op: StoreCommit, Err: err, Shard: shard}
	}
	return nil
}

// errCommitUnconfirmed: COMMIT answered, but after the attempt's deadline.
var errCommitUnconfirmed = errors.New("COMMIT answered after the attempt's deadline: treated as of unknown outcome")

// commit commits tx, and counts a COMMIT that answers after ctx ended as
// of unknown outcome: a cancel that reached the server while the commit
// waited for a synchronous standby ends that wait with a warning and a
// success, the commit kept on the primary alone. Retried, the event's row
// is found, and the claim that finds it waits for the standby (see
// pgtier.Store.Claim) before anything is acked.
func commit(ctx context.Context, tx pgx.Tx) error {
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	if ctx.Err() != nil {
		return errCommitUnconfirmed
	}
	return nil
}

// claim claims the dedup rows of the events at idx (distinct IDs) in event
// ID order, so that two batches lock shared rows in one order, and returns
// the store's answer by event index, with the store's history.
func (g *Guard) claim(ctx context.Context, store Store, tx pgx.Tx, events []Event, idx []int) (map[int]tier.ClaimResult, tier.History, error) {
	order := slices.Clone(idx)
	slices.SortFunc(order, func(a, b int) int { return strings.Compare(events[a].ID, events[b].ID) })
	batch := make([]Event, len(order))
	for k, i := range order {
		batch[k] = events[i]
	}
	claims, history, err := store.Claim(ctx, tx, g.scope, batch)
	if err != nil {
		return nil, "", err
	}
	out := make(map[int]tier.ClaimResult, len(order))
	for k, i := range order {
		out[i] = claims[k]
	}
	return out, history, nil
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

// confirm takes the history of b's store from a statement sent after b was
// screened (a shared read, see shardHistory) and settles the marked events
// whose marker names it; the others go to the store. A store that does not
// answer confirms nothing. It is for a batch that claims nothing: one that
// does reads the history in its claim (processInStore).
func (g *Guard) confirm(ctx context.Context, b *Batch) {
	h, err := g.readHistory(ctx, b)
	if err != nil {
		g.log.DebugContext(ctx, "store history unread: done markers not trusted", "events", len(b.marked), "shard", b.shard, "err", err)
		h = ""
	}
	g.settleLate(ctx, b, h)
}

// readHistory takes the history of b's store from a statement sent after b
// was screened.
func (g *Guard) readHistory(ctx context.Context, b *Batch) (tier.History, error) {
	sh := g.histories[b.shard]
	began := time.Now()
	h, err := sh.since(ctx, g.stores[b.shard], b.screened)
	g.obs.ObserveStage(ctx, StageHistory, len(b.marked), time.Since(began), err)
	if err != nil {
		return "", err
	}
	sh.saw(ctx, g.log, b.shard, h)
	return h, nil
}

// settleLate settles b's marked events by h (settle) and sends the others
// to the store.
func (g *Guard) settleLate(ctx context.Context, b *Batch, h tier.History) {
	if late := g.settle(ctx, b, h); len(late) > 0 {
		b.toStore = append(b.toStore, late...)
		slices.Sort(b.toStore)
	}
}

// named is the shard a StoreError names: -1 with one store.
func (g *Guard) named(shard int) int {
	if len(g.stores) == 1 {
		return -1
	}
	return shard
}

// settle settles the marked events of b whose marker names history h as
// duplicates (OutcomeDuplicateRedis), and returns the others, ascending:
// their markers are from another history of the store, one that may hold
// commits the current one lost, so only the store can decide them.
func (g *Guard) settle(ctx context.Context, b *Batch, h tier.History) []int {
	var late []int
	for i, mh := range b.marked {
		if mh.Confirms(h) {
			b.res[i] = Result{Outcome: OutcomeDuplicateRedis}
			continue
		}
		late = append(late, i)
	}
	b.marked = nil
	if len(late) > 0 && h != "" {
		g.log.DebugContext(ctx, "done markers of another history: the store decides", "events", len(late), "shard", b.shard, "history", string(h))
	}
	slices.Sort(late)
	return late
}
