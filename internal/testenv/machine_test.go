package testenv

import (
	"sync/atomic"
	"testing"
	"time"
)

// TestTheMachineLockKeepsExclusiveAlone: an Exclusive holder waits for the
// Shared holders that run, Shared callers that come meanwhile wait for it,
// and a subtest of a Shared holder does not wait at all.
func TestTheMachineLockKeepsExclusiveAlone(t *testing.T) {
	lockDir = t.TempDir()
	var inside, exclusive atomic.Int32
	var overlap atomic.Bool
	hold := func(t *testing.T, take func(testing.TB), alone bool) {
		take(t)
		if alone {
			exclusive.Add(1)
			defer exclusive.Add(-1)
			overlap.CompareAndSwap(false, inside.Load() > 0)
		} else {
			inside.Add(1)
			defer inside.Add(-1)
			overlap.CompareAndSwap(false, exclusive.Load() > 0)
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Run("all", func(t *testing.T) {
		t.Run("shared", func(t *testing.T) {
			t.Parallel()
			hold(t, Shared, false)
			t.Run("nested", func(t *testing.T) { hold(t, Shared, false) })
		})
		t.Run("exclusive", func(t *testing.T) {
			t.Parallel()
			time.Sleep(50 * time.Millisecond)
			hold(t, Exclusive, true)
		})
		for _, name := range []string{"later-1", "later-2"} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				time.Sleep(100 * time.Millisecond)
				hold(t, Shared, false)
			})
		}
	})
	if overlap.Load() {
		t.Fatal("an Exclusive holder ran beside a Shared one")
	}
}
