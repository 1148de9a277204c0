package e2e

import (
	"fmt"
	"testing"

	"github.com/idemhq/idem/internal/crashpoint"
)

// TestCrashAtEveryStepLosesNothingAndDoublesNothing kills a consumer with
// SIGKILL at each step of DESIGN.md's table while it holds a batch of
// deliveries, then lets two healthy consumers finish the stream. Every event
// must be applied exactly once, whatever the victim left behind: an orphaned
// Redis lease, an open transaction, a commit without a done marker, a done
// marker without an ack.
func TestCrashAtEveryStepLosesNothingAndDoublesNothing(t *testing.T) {
	for _, step := range crashpoint.Steps {
		t.Run(string(step), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, "", "")
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

// TestRepeatedKillsDuringAStream kills consumers again and again, at
// different points, while the stream flows, restarting each one.
func TestRepeatedKillsDuringAStream(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
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
}
