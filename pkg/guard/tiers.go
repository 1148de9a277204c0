package guard

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/internal/tier"
)

// FastPath is the optional first tier: a shared, lossy lease table, which
// redistier.Filter implements with Redis. Its methods take types internal
// to idem, so it is not a plug-in point: the guard's safety argument is
// made for the tiers idem ships, and checked by their shared suite
// (package guardtest).
// It can only say "done in this history of the store" or "not known to be
// done"; it never makes the guard drop an event on a pending lease, nor on
// a marker whose history the store has not just confirmed. Methods take
// slices so that a batch of events costs one round trip.
type FastPath interface {
	// Claim takes a lease on each ID it can, naming history (the last the
	// caller knew) in it. A done marker comes back with the history it
	// names. It reports faults per item as skipped (with the fault) rather
	// than failing: the caller then goes straight to the authoritative tier.
	Claim(ctx context.Context, scope string, history tier.History, events []Event) []tier.FastResult
	// MarkDone records that the events committed in history, overwriting
	// what their keys held. Best effort: a lost marker costs one trip to
	// the store on the next duplicate.
	MarkDone(ctx context.Context, scope string, history tier.History, events []Event) error
	// Release drops leases that this caller still holds, so a retry does not
	// wait for them to expire. A lease someone else holds is left alone.
	Release(ctx context.Context, scope string, leases []tier.Lease) error
}

// Store is the authoritative tier, which pgtier.Store implements with
// PostgreSQL; like FastPath it is not a plug-in point. Claim must insert a dedup row for each
// event inside tx, so that the row commits or rolls back with the handler's
// effect. A store that prunes rows must also refuse, at claim time, an event
// whose row it may have pruned and cannot find (expired,
// future or untimed): only the store knows where it cut.
//
// Claim also returns the store's history (tier.History), read in the same
// statement: the history the rows it inserts commit in, and the one it
// found existing rows in. History reads it alone, in one small query, for a
// batch whose done markers need confirming and which claims nothing.
type Store interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Claim(ctx context.Context, tx pgx.Tx, scope string, events []Event) ([]tier.ClaimResult, tier.History, error)
	History(ctx context.Context) (tier.History, error)
}

// maxScopeLen is the longest scope a Guard accepts, in bytes.
const maxScopeLen = 64

// ValidateScope reports whether scope can name a consuming service. It may not
// contain ':' so that Redis keys "prefix:scope:id" stay unambiguous.
func ValidateScope(scope string) error {
	if scope == "" || len(scope) > maxScopeLen {
		return fmt.Errorf("scope %q: want 1 to %d bytes", scope, maxScopeLen)
	}
	for i := 0; i < len(scope); i++ {
		if c := scope[i]; !scopeByte(c) {
			return fmt.Errorf("scope %q: byte %d (%q) is outside [A-Za-z0-9_.-]", scope, i, c)
		}
	}
	return nil
}

// refusal returns the error that stands for a store's refusal, nil for
// other answers.
func refusal(r tier.ClaimResult) error {
	switch r {
	case tier.ClaimExpired:
		return ErrBeyondRetention
	case tier.ClaimFuture:
		return ErrFutureEvent
	case tier.ClaimUntimed:
		return ErrUntimedEvent
	}
	return nil
}
