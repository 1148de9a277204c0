package testenv

import (
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The machine lock keeps a test that needs the machine to itself apart from
// the tests of every test process on the machine that share it: go test runs
// two packages at once, so a test that is not parallel within its package
// may still have another package's tests beside it.
//
// Exclusive holds the lock alone; Shared with any other Shared. Readers
// pass through a turnstile that a waiting Exclusive holds, so a stream of
// Shared tests cannot keep an Exclusive one waiting: it waits only for the
// ones already running. Both are flock(2) locks on files in the temporary
// directory, released by the kernel if the process dies.
var (
	lockDir = os.TempDir()
	// shared are the tests of this process that hold the lock Shared, by
	// name: a subtest's hold is its parent's (taking it again could wait
	// on an Exclusive that waits on the parent).
	shared sync.Map
)

// Exclusive waits until no test on the machine holds the machine lock, then
// holds it until t ends; meanwhile Shared callers wait. It is for a test
// whose assertions need the machine's CPU (a cluster booted and faulted on
// a schedule), not for one that merely uses much of it.
func Exclusive(t testing.TB) {
	t.Helper()
	turnstile := lockFile(t, "turnstile")
	waited := flock(t, turnstile, syscall.LOCK_EX)
	room := lockFile(t, "room")
	waited += flock(t, room, syscall.LOCK_EX)
	if waited > time.Second {
		t.Logf("testenv: waited %s for the machine lock", waited.Round(time.Second))
	}
	t.Cleanup(func() {
		room.Close()
		turnstile.Close()
	})
}

// Shared holds the machine lock beside other Shared holders until t ends,
// after waiting for any Exclusive holder (and any that waits) to end.
func Shared(t testing.TB) {
	t.Helper()
	name := t.Name()
	for p := name; ; {
		if _, ok := shared.Load(p); ok {
			return // held by t or a test t runs under
		}
		i := strings.LastIndex(p, "/")
		if i < 0 {
			break
		}
		p = p[:i]
	}
	turnstile := lockFile(t, "turnstile")
	waited := flock(t, turnstile, syscall.LOCK_SH)
	room := lockFile(t, "room")
	waited += flock(t, room, syscall.LOCK_SH)
	turnstile.Close()
	if waited > time.Second {
		t.Logf("testenv: waited %s for the machine lock", waited.Round(time.Second))
	}
	shared.Store(name, true)
	t.Cleanup(func() {
		shared.Delete(name)
		room.Close()
	})
}

func lockFile(t testing.TB, name string) *os.File {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(lockDir, "idem-test-machine."+name), os.O_CREATE|os.O_RDONLY, 0o644)
	if err != nil {
		t.Fatalf("testenv: machine lock: %v", err)
	}
	return f
}

// flock takes how on f, waiting for it, and returns how long it waited.
func flock(t testing.TB, f *os.File, how int) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		err := syscall.Flock(int(f.Fd()), how)
		if err == nil {
			return time.Since(start)
		}
		if err != syscall.EINTR {
			f.Close()
			t.Fatalf("testenv: machine lock: %v", err)
		}
	}
}
