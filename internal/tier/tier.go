// Package tier holds the answers the guard's two tiers give it: the fast
// tier's per-event state and leases, and the store's claim results. They
// are idem's own, so that the tiers' interfaces cannot be implemented
// outside idem (the safety argument covers the tiers it ships).
package tier

import (
	"context"
	"fmt"
	"slices"
	"time"
)

// FastState is the fast tier's answer for one event.
type FastState int

const (
	// FastSkipped: the tier was not asked or did not answer (breaker open,
	// timeout, error). Go to the store.
	FastSkipped FastState = iota
	// FastAcquired: the caller now holds the lease (Token).
	FastAcquired
	// FastPending: another consumer holds a lease. It may be processing the
	// event right now, or it may have crashed: go to the store, which
	// serialises the two.
	FastPending
	// FastDone: the event committed before, with payload hash Hash, in
	// the store's history History.
	FastDone
)

func (s FastState) String() string {
	switch s {
	case FastAcquired:
		return "acquired"
	case FastPending:
		return "pending"
	case FastDone:
		return "done"
	}
	return "skipped"
}

// FastResult is the fast tier's answer for one event of a Claim.
type FastResult struct {
	State FastState
	Token string // the caller's lease token, when State is FastAcquired
	Hash  []byte // the committed payload hash, when State is FastDone
	// History is the history a done marker names, when State is
	// FastDone: the marker is true only while the store still reports it.
	History History
	Err     error // why the tier was skipped, when State is FastSkipped
}

// Lease names a lease that a Claim acquired.
type Lease struct {
	ID    string
	Token string
}

// ClaimResult is the store's answer for one event of a Claim.
type ClaimResult int

const (
	// ClaimInserted: the row is ours; apply the effect in the same tx.
	ClaimInserted ClaimResult = iota + 1
	// ClaimDuplicate: a committed row with the same payload hash exists.
	ClaimDuplicate
	// ClaimConflict: a committed row with a different payload hash exists.
	ClaimConflict
	// ClaimExpired: no row exists, and the event is older than the replay
	// horizon the store enforces: its row may have been pruned. Refused.
	ClaimExpired
	// ClaimFuture: no row exists, and the event's time is further ahead
	// than the store's clock skew allows. Refused.
	ClaimFuture
	// ClaimUntimed: no row exists, the event has no time, and the store has
	// pruned rows. Refused.
	ClaimUntimed
)

// Refused reports whether the store refused to claim the event
// (ClaimExpired, ClaimFuture or ClaimUntimed).
func (r ClaimResult) Refused() bool { return r >= ClaimExpired && r <= ClaimUntimed }

func (r ClaimResult) String() string {
	switch r {
	case ClaimInserted:
		return "inserted"
	case ClaimDuplicate:
		return "duplicate"
	case ClaimConflict:
		return "conflict"
	case ClaimExpired:
		return "expired"
	case ClaimFuture:
		return "future"
	case ClaimUntimed:
		return "untimed"
	}
	return fmt.Sprintf("ClaimResult(%d)", int(r))
}

// Apply is what the guard tells the code a handler calls inside its apply
// function (package outbox): whose transaction it is.
type Apply struct {
	Scope string
	// IDs are the IDs of the events whose dedup rows the transaction
	// holds, in no particular order.
	IDs []string
	// Times are the events' times, by index of IDs (zero: untimed); nil
	// when no event has one.
	Times []time.Time

	index map[string]int // position in IDs, built on the first lookup in a large batch
}

// find returns id's position in IDs, or -1. Like the transaction, it is
// not for concurrent use.
func (a *Apply) find(id string) int {
	if len(a.IDs) <= 8 {
		return slices.Index(a.IDs, id)
	}
	if a.index == nil {
		a.index = make(map[string]int, len(a.IDs))
		for i, v := range a.IDs {
			a.index[v] = i
		}
	}
	if i, ok := a.index[id]; ok {
		return i
	}
	return -1
}

// TimeOf returns the time of event id (zero if untimed or not held). Like
// Holds, it is not for concurrent use.
func (a *Apply) TimeOf(id string) time.Time {
	if i := a.find(id); a.Times != nil && i >= 0 {
		return a.Times[i]
	}
	return time.Time{}
}

// Holds reports whether the transaction holds the dedup row of event id.
// Like the transaction, it is not for concurrent use.
func (a *Apply) Holds(id string) bool { return a.find(id) >= 0 }

type applyKey struct{}

// WithApply returns ctx carrying a, for the apply function's calls.
func WithApply(ctx context.Context, a *Apply) context.Context {
	return context.WithValue(ctx, applyKey{}, a)
}

// ApplyFrom returns the Apply ctx carries, if any.
func ApplyFrom(ctx context.Context) (*Apply, bool) {
	a, ok := ctx.Value(applyKey{}).(*Apply)
	return a, ok
}

type destinationsKey struct{}

// WithDestinations returns ctx carrying the outbox destinations a service
// declared (the front door's Config.Outbox), so that outbox.Enqueue
// refuses a message To any other inside the handler's transaction.
func WithDestinations(ctx context.Context, names map[string]bool) context.Context {
	return context.WithValue(ctx, destinationsKey{}, names)
}

// DestinationsFrom returns the destinations ctx carries; false when no
// service declared them (a guard used alone, or the binary), and no
// destination is refused.
func DestinationsFrom(ctx context.Context) (map[string]bool, bool) {
	names, ok := ctx.Value(destinationsKey{}).(map[string]bool)
	return names, ok
}
