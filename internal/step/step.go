// Package step names the points of the guard's and the consumer's flow at
// which the crash harness may kill a process, and calls the hook the
// harness installs there. Nothing in the shipped binary installs one, so
// Reached costs an atomic load.
package step

import (
	"context"
	"sync/atomic"
)

// The steps, in flow order.
const (
	FastClaimed  = "after_fast_claim"  // Redis SET NX answered (or was skipped)
	StoreClaimed = "after_store_claim" // dedup rows inserted, tx open
	Applied      = "after_apply"       // handler returned, tx open
	Committed    = "after_commit"      // dedup rows and effects committed
	MarkedDone   = "after_mark_done"   // Redis done markers written (or failed)
	BeforeAck    = "before_ack"        // outcome durable, ack not sent
)

// All lists every step in flow order.
var All = []string{FastClaimed, StoreClaimed, Applied, Committed, MarkedDone, BeforeAck}

var hook atomic.Pointer[func(context.Context, string)]

// SetHook makes f see every step this process reaches; nil removes it.
func SetHook(f func(ctx context.Context, step string)) {
	if f == nil {
		hook.Store(nil)
		return
	}
	hook.Store(&f)
}

type ctxKey struct{}

// ctxHooks is set once a context hook was ever made, so that Reached looks
// in contexts only in the tests that use them.
var ctxHooks atomic.Bool

// WithHook returns a context whose calls see f at every step reached on
// their own path (the done markers, written in the background, are not):
// for a test that runs beside others in one process.
func WithHook(ctx context.Context, f func(ctx context.Context, step string)) context.Context {
	ctxHooks.Store(true)
	return context.WithValue(ctx, ctxKey{}, f)
}

// Reached tells the hooks, if any, that the process reached s.
func Reached(ctx context.Context, s string) {
	if f := hook.Load(); f != nil {
		(*f)(ctx, s)
	}
	if !ctxHooks.Load() {
		return
	}
	if f, ok := ctx.Value(ctxKey{}).(func(context.Context, string)); ok {
		f(ctx, s)
	}
}
