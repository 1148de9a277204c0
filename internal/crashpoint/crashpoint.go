// Package crashpoint kills the current process with SIGKILL at a named step,
// so that crash tests exercise real process death at exact points of the
// guard's flow rather than goroutine exits.
//
// It is armed by two environment variables read once at start:
// IDEM_CRASH_AT names the step (a step such as after_commit, or
// before_ack, from package step), and IDEM_CRASH_AFTER is how many times the step must be
// passed before the kill (default 1: the first time).
package crashpoint

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"sync/atomic"
	"syscall"

	"github.com/idemhq/idem/internal/step"
)

// Marker starts the line printed to stderr right before the kill; the
// step follows it.
const Marker = "crashpoint: SIGKILL at "

// Env names.
const (
	EnvAt    = "IDEM_CRASH_AT"
	EnvAfter = "IDEM_CRASH_AFTER"
)

// Steps lists every step a crash can be armed at, in flow order.
var Steps = step.All

// Install arms the guard's, the consumer's and the relay's steps (package
// step) from the environment: the process SIGKILLs itself at the armed one.
// Nothing is installed when nothing is armed.
func Install(getenv func(string) string) error {
	crash, err := Arm(getenv, slices.Concat(Steps, step.Relay), nil)
	if crash == nil || err != nil {
		return err
	}
	step.SetHook(func(_ context.Context, s string) { crash(s) })
	return nil
}

// Arm reads IDEM_CRASH_AT and IDEM_CRASH_AFTER and returns a func that
// SIGKILLs the process on the armed step's after-th pass, or nil when
// nothing is armed. known lists the steps that may be armed. last, if set,
// runs right before the kill (to flush counters, say: nothing the broker,
// Redis or Postgres could see).
func Arm(getenv func(string) string, known []string, last func()) (func(step string), error) {
	at := getenv(EnvAt)
	if at == "" {
		return nil, nil
	}
	if !slices.Contains(known, at) {
		return nil, fmt.Errorf("%s=%q: not a crash point (want one of %v)", EnvAt, at, known)
	}
	after := int64(1)
	if s := getenv(EnvAfter); s != "" {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("%s=%q: want a positive integer", EnvAfter, s)
		}
		after = n
	}
	var passed atomic.Int64
	return func(step string) {
		if step == at && passed.Add(1) >= after {
			if last != nil {
				last()
			}
			fmt.Fprintf(os.Stderr, "%s%s\n", Marker, step)
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // never returns: the signal is on its way
		}
	}, nil
}
