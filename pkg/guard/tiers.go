package guard

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// FastPath is the optional first tier: a shared, lossy lease table (Redis).
// It can only say "certainly done" or "not known to be done"; it never makes
// the guard drop an event on a pending lease. Methods take slices so that a
// batch of events costs one round trip.
type FastPath interface {
	// Claim takes a lease on each ID it can. It reports faults per item as
	// FastSkipped (with Err) rather than failing: the caller then goes
	// straight to the authoritative tier.
	Claim(ctx context.Context, scope string, events []Event) []FastResult
	// MarkDone records that the events committed. Best effort: a lost
	// marker costs one trip to the store on the next duplicate.
	MarkDone(ctx context.Context, scope string, events []Event) error
	// Release drops leases that this caller still holds, so a retry does not
	// wait for them to expire. A lease someone else holds is left alone.
	Release(ctx context.Context, scope string, leases []Lease) error
}

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
	// FastDone: the event committed before, with payload hash Hash.
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
	Err   error  // why the tier was skipped, when State is FastSkipped
}

// Lease names a lease that a Claim acquired.
type Lease struct {
	ID    string
	Token string
}

// Store is the authoritative tier. Claim must insert a dedup row for each
// event inside tx, so that the row commits or rolls back with the handler's
// effect. A store that prunes rows must also refuse, at claim time, an event
// whose row it may have pruned and cannot find (ClaimExpired, ClaimFuture,
// ClaimUntimed): only the store knows where it cut.
type Store interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Claim(ctx context.Context, tx pgx.Tx, scope string, events []Event) ([]ClaimResult, error)
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

// Err returns the error that stands for a refusal, nil for other results.
func (r ClaimResult) Err() error {
	switch r {
	case ClaimExpired:
		return ErrBeyondRetention
	case ClaimFuture:
		return ErrFutureEvent
	case ClaimUntimed:
		return ErrUntimedEvent
	}
	return nil
}

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

// MaxScopeLen is the longest scope a Guard accepts, in bytes.
const MaxScopeLen = 64

// ValidateScope reports whether scope can name a consuming service. It may not
// contain ':' so that Redis keys "prefix:scope:id" stay unambiguous.
func ValidateScope(scope string) error {
	if scope == "" || len(scope) > MaxScopeLen {
		return fmt.Errorf("scope %q: want 1 to %d bytes", scope, MaxScopeLen)
	}
	for i := 0; i < len(scope); i++ {
		if c := scope[i]; !scopeByte(c) {
			return fmt.Errorf("scope %q: byte %d (%q) is outside [A-Za-z0-9_.-]", scope, i, c)
		}
	}
	return nil
}
