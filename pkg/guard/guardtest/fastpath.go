// Package guardtest holds behaviour suites that every implementation of the
// guard's interfaces must pass, as watermill's pubsub/tests does for its
// Pub/Subs. Run them from the implementation's own tests.
package guardtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/guard"
)

// NewFastPath returns a fresh, empty FastPath for one subtest.
type NewFastPath func(t *testing.T) guard.FastPath

// TestFastPath runs the FastPath behaviour suite.
func TestFastPath(t *testing.T, newFast NewFastPath) {
	cases := []struct {
		name string
		fn   func(t *testing.T, f guard.FastPath)
	}{
		{"FirstClaimAcquiresSecondSeesPending", testFirstClaim},
		{"DoneMarkerCarriesHash", testDone},
		{"DoneMarkerNamesItsHistory", testDoneHistory},
		{"ReleaseDeletesOwnLease", testReleaseOwn},
		{"ReleaseLeavesOthersLease", testReleaseOthers},
		{"ReleaseNeverDeletesDone", testReleaseAfterDone},
		{"ScopesAreIsolated", testScopes},
		{"AnyIDBytesMapToDistinctKeys", testIDBytes},
		{"BatchClaimAnswersPerItem", testBatch},
		{"ManyLeasesReleaseTogether", testReleaseMany},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.fn(t, newFast(t))
		})
	}
}

// hist is the history the suite's markers and leases name.
const hist tier.History = "0123456789ab"

func ev(id string) guard.Event { return guard.Event{ID: id, Hash: guard.HashFields(id)} }

func uniqueID() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return "evt_" + hex.EncodeToString(b[:])
}

func claim1(t *testing.T, f guard.FastPath, scope string, e guard.Event) tier.FastResult {
	t.Helper()
	r := f.Claim(context.Background(), scope, hist, []guard.Event{e})
	require.Len(t, r, 1)
	return r[0]
}

func testFirstClaim(t *testing.T, f guard.FastPath) {
	e := ev(uniqueID())
	first := claim1(t, f, "svc", e)
	require.Equal(t, tier.FastAcquired, first.State, "err: %v", first.Err)
	require.NotEmpty(t, first.Token)
	second := claim1(t, f, "svc", e)
	require.Equal(t, tier.FastPending, second.State, "a held lease must read as pending, never as done")
}

func testDone(t *testing.T, f guard.FastPath) {
	e := ev(uniqueID())
	require.Equal(t, tier.FastAcquired, claim1(t, f, "svc", e).State)
	require.NoError(t, f.MarkDone(context.Background(), "svc", hist, []guard.Event{e}))
	r := claim1(t, f, "svc", e)
	require.Equal(t, tier.FastDone, r.State)
	require.Equal(t, e.Hash, r.Hash)
	require.Equal(t, hist, r.History)
	// A claim never overwrites a done marker.
	require.Equal(t, tier.FastDone, claim1(t, f, "svc", e).State)
}

// testDoneHistory: a done marker comes back with the history it was
// written in, and a marker written again in another history replaces it
// (the guard rewrites a marker it could not trust once its event's row is
// found or committed).
func testDoneHistory(t *testing.T, f guard.FastPath) {
	e := ev(uniqueID())
	require.Equal(t, tier.FastAcquired, claim1(t, f, "svc", e).State)
	require.NoError(t, f.MarkDone(context.Background(), "svc", "aaaaaaaaaaaa", []guard.Event{e}))
	r := claim1(t, f, "svc", e)
	require.Equal(t, tier.FastDone, r.State)
	require.Equal(t, tier.History("aaaaaaaaaaaa"), r.History)
	require.NoError(t, f.MarkDone(context.Background(), "svc", hist, []guard.Event{e}))
	r = claim1(t, f, "svc", e)
	require.Equal(t, tier.FastDone, r.State)
	require.Equal(t, hist, r.History)
	require.Equal(t, e.Hash, r.Hash)
}

func testReleaseOwn(t *testing.T, f guard.FastPath) {
	e := ev(uniqueID())
	r := claim1(t, f, "svc", e)
	require.Equal(t, tier.FastAcquired, r.State)
	require.NoError(t, f.Release(context.Background(), "svc", []tier.Lease{{ID: e.ID, Token: r.Token}}))
	require.Equal(t, tier.FastAcquired, claim1(t, f, "svc", e).State, "a released lease must be claimable again")
}

func testReleaseOthers(t *testing.T, f guard.FastPath) {
	e := ev(uniqueID())
	require.Equal(t, tier.FastAcquired, claim1(t, f, "svc", e).State)
	require.NoError(t, f.Release(context.Background(), "svc", []tier.Lease{{ID: e.ID, Token: "not-the-holder"}}))
	require.Equal(t, tier.FastPending, claim1(t, f, "svc", e).State, "release with another token must not delete the lease")
}

func testReleaseAfterDone(t *testing.T, f guard.FastPath) {
	e := ev(uniqueID())
	r := claim1(t, f, "svc", e)
	require.NoError(t, f.MarkDone(context.Background(), "svc", hist, []guard.Event{e}))
	require.NoError(t, f.Release(context.Background(), "svc", []tier.Lease{{ID: e.ID, Token: r.Token}}))
	require.Equal(t, tier.FastDone, claim1(t, f, "svc", e).State)
}

func testScopes(t *testing.T, f guard.FastPath) {
	e := ev(uniqueID())
	require.Equal(t, tier.FastAcquired, claim1(t, f, "billing", e).State)
	require.NoError(t, f.MarkDone(context.Background(), "billing", hist, []guard.Event{e}))
	require.Equal(t, tier.FastAcquired, claim1(t, f, "ledger", e).State, "another scope must not see billing's marker")
}

func testIDBytes(t *testing.T, f guard.FastPath) {
	base := uniqueID()
	ids := []string{base, base + ":x", base + "\x00", base + "é", base + " "}
	for _, id := range ids {
		require.Equal(t, tier.FastAcquired, claim1(t, f, "svc", ev(id)).State, "id %q collided with another", id)
	}
}

func testBatch(t *testing.T, f guard.FastPath) {
	a, b, c := ev(uniqueID()), ev(uniqueID()), ev(uniqueID())
	require.Equal(t, tier.FastAcquired, claim1(t, f, "svc", a).State)
	require.NoError(t, f.MarkDone(context.Background(), "svc", hist, []guard.Event{b}))
	got := f.Claim(context.Background(), "svc", hist, []guard.Event{a, b, c})
	require.Len(t, got, 3)
	require.Equal(t, tier.FastPending, got[0].State)
	require.Equal(t, tier.FastDone, got[1].State)
	require.Equal(t, tier.FastAcquired, got[2].State)
}

// testReleaseMany claims, releases and claims again 64 events in one call
// each: on a Redis Cluster their keys span every master.
func testReleaseMany(t *testing.T, f guard.FastPath) {
	ctx := context.Background()
	events := make([]guard.Event, 64)
	for i := range events {
		events[i] = ev(uniqueID())
	}
	var leases []tier.Lease
	for i, r := range f.Claim(ctx, "svc", hist, events) {
		require.Equal(t, tier.FastAcquired, r.State, "event %d: %v", i, r.Err)
		leases = append(leases, tier.Lease{ID: events[i].ID, Token: r.Token})
	}
	require.NoError(t, f.Release(ctx, "svc", leases))
	for i, r := range f.Claim(ctx, "svc", hist, events) {
		require.Equal(t, tier.FastAcquired, r.State, "event %d was not released: %v", i, r.Err)
	}
}
