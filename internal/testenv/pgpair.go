package testenv

import (
	"errors"
	"testing"

	"github.com/idemhq/idem/internal/sandbox"
)

// StartPair starts a primary and a streaming standby of the test's own
// (sandbox.StartPair), removed at the end of the test.
func StartPair(t testing.TB, cfg sandbox.PairConfig) *sandbox.Pair {
	t.Helper()
	p, err := sandbox.StartPair("", cfg)
	if errors.Is(err, sandbox.ErrNoInitdb) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Remove)
	return p
}
