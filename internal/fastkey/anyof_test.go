package fastkey_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/fastkey"
	"github.com/idemhq/idem/internal/testenv"
)

// TestAnyOfTellsAnEmptyScopeFromAnAbsentKey: `idem inspect` with a prefix
// or scope other than the consumers' said "no key" for a processed event,
// a plausible wrong answer. AnyOf finds whether the scope has any key under
// the prefix, of either key shape, and nothing of a scope that only starts
// the same or of a pattern a scope's characters would make.
func TestAnyOfTellsAnEmptyScopeFromAnAbsentKey(t *testing.T) {
	t.Parallel()
	rdb, prefix := testenv.Redis(t)
	ctx := context.Background()
	has := func(prefix, scope string) bool {
		t.Helper()
		found, known, err := fastkey.AnyOf(ctx, rdb, prefix, scope)
		require.NoError(t, err)
		require.True(t, known)
		return found
	}
	require.False(t, has(prefix, "pay"), "nothing written yet")
	require.NoError(t, rdb.Set(ctx, fastkey.Key(prefix, "payments", "e1"), "done:x", 0).Err())
	require.True(t, has(prefix, "payments"))
	require.False(t, has(prefix, "pay"), "a scope that starts the same is another scope")
	require.False(t, has(prefix, "pay*"), "a scope's characters are not a pattern")
	require.False(t, has(prefix+"-other", "payments"), "another prefix")
	require.NoError(t, rdb.Set(ctx, fastkey.Key(prefix, "braces", "{e2}"), "done:x", 0).Err())
	require.True(t, has(prefix, "braces"), "the key of an ID with braces")
}
