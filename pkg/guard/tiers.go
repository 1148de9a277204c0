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
// It can only say "certainly done" or "not known to be done"; it never makes
// the guard drop an event on a pending lease. Methods take slices so that a
// batch of events costs one round trip.
type FastPath interface {
	// Claim takes a lease on each ID it can. It reports faults per item as
	// skipped (with the fault) rather than failing: the caller then goes
	// straight to the authoritative tier.
	Claim(ctx context.Context, scope string, events []Event) []tier.FastResult
	// MarkDone records that the events committed. Best effort: a lost
	// marker costs one trip to the store on the next duplicate.
	MarkDone(ctx context.Context, scope string, events []Event) error
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
type Store interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Claim(ctx context.Context, tx pgx.Tx, scope string, events []Event) ([]tier.ClaimResult, error)
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
