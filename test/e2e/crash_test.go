package e2e

import (
	"fmt"
	"testing"

	"github.com/idemhq/idem/internal/crashpoint"
)

// modes are the consumer's two pipelines: batches (the default) and one
// delivery at a time.
var modes = []struct {
	name string
	env  []string
}{
	{"batched", nil},
	{"per-event", []string{"IDEM_CONSUMER_BATCH_SIZE=1", "IDEM_CONSUMER_WORKERS=8"}},
}

// TestCrashAtEveryStepLosesNothingAndDoublesNothing kills a consumer with
// SIGKILL at each step of the guard's flow while it holds deliveries, in
// both pipelines, then lets two healthy consumers finish the stream. Every
// event must be applied exactly once, whatever the victim left behind: an
// orphaned Redis lease, an open transaction, a commit without a done marker,
// a done marker without an ack.
func TestCrashAtEveryStepLosesNothingAndDoublesNothing(t *testing.T) {
	for _, mode := range modes {
		for _, step := range crashpoint.Steps {
			t.Run(mode.name+"/"+string(step), func(t *testing.T) {
				t.Parallel()
				e := newEnv(t, "", "")
				e.vars = append(e.vars, mode.env...)
				m := e.publish(400, 0.3)
				victim := e.consume("victim", crashpoint.EnvAt+"="+string(step), crashpoint.EnvAfter+"=40")
				e.waitKilled(victim, string(step))
				for i := range 2 {
					e.consume(fmt.Sprintf("survivor-%d", i))
				}
				e.waitApplied(m)
				e.stopAll()
				e.requireExactlyOnce(m)
			})
		}
	}
}

// TestRepeatedKillsDuringAStream kills consumers again and again, at
// different points, while the stream flows, restarting each one.
func TestRepeatedKillsDuringAStream(t *testing.T) {
	for _, mode := range modes {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, "", "")
			e.vars = append(e.vars, mode.env...)
			m := e.publish(1500, 0.25)
			for round, step := range crashpoint.Steps {
				p := e.consume(fmt.Sprintf("victim-%d", round), crashpoint.EnvAt+"="+string(step), crashpoint.EnvAfter+"=15")
				e.waitKilled(p, string(step))
			}
			e.consume("survivor-0")
			e.consume("survivor-1")
			e.waitApplied(m)
			e.stopAll()
			e.requireExactlyOnce(m)
		})
	}
}
