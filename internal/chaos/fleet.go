package chaos

import (
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/idemhq/idem/internal/crashpoint"
	"github.com/idemhq/idem/internal/fleet"
)

// consumers is the run's fleet: a fleet.Group of `idem consume` processes
// named <prefix><slot>-<generation>, which also records the armed crash
// points that fired.
type consumers struct {
	*fleet.Group
	prefix string
	t0     time.Time

	size int

	mu      sync.Mutex
	crashes []CrashRecord
	armed   map[int]armed // slot -> the armed consumer started there
}

// armed is a consumer started to SIGKILL itself at step.
type armed struct{ name, step string }

// CrashRecord is one consumer that died of its armed crash point.
type CrashRecord struct {
	Consumer string  `json:"consumer"`
	Step     string  `json:"step"`
	At       float64 `json:"at"` // seconds from the start
}

// startConsumers starts o.Consumers consumers; env gives a slot's env.
func startConsumers(o Options, prefix string, env func(slot int) []string, t0 time.Time) (*consumers, error) {
	c := &consumers{prefix: prefix, t0: t0, size: o.Consumers, armed: map[int]armed{}}
	var args []string
	if o.ConfigPath != "" {
		args = []string{"--config", o.ConfigPath}
	}
	g, err := fleet.StartGroup(fleet.GroupConfig{
		Size: o.Consumers,
		Spec: func(slot, gen int) fleet.Spec {
			return fleet.Spec{Bin: o.Bin, Name: fmt.Sprintf("%s%d-%d", prefix, slot, gen), Dir: o.Dir, Env: env(slot), Args: args}
		},
		RestartDelay: 300 * time.Millisecond,
		OnExit: func(p *fleet.Proc, armed bool) bool {
			if step, ok := p.CrashedAt(); ok && armed {
				c.mu.Lock()
				c.crashes = append(c.crashes, CrashRecord{Consumer: p.Name, Step: step, At: time.Since(t0).Seconds()})
				c.mu.Unlock()
			}
			return true
		},
	}, nil)
	c.Group = g
	return c, err
}

// arm replaces slot's consumer with one that SIGKILLs itself at step on
// its after-th pass.
func (c *consumers) arm(slot int, step string, after int) (string, error) {
	slot = c.target(slot)
	name, err := c.Replace(slot, []string{crashpoint.EnvAt + "=" + step, crashpoint.EnvAfter + "=" + strconv.Itoa(after)})
	c.mu.Lock()
	c.armed[slot] = armed{name, step}
	c.mu.Unlock()
	return name, err
}

// armedSteps returns the steps of the armed consumers that still run,
// short of their step.
func (c *consumers) armedSteps() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var steps []string
	for s, a := range c.armed {
		if c.waiting(s) {
			steps = append(steps, a.step)
		}
	}
	return steps
}

// waiting reports whether slot runs its armed consumer, which has not
// reached its step yet. Callers hold c.mu.
func (c *consumers) waiting(slot int) bool {
	p := c.Current(slot)
	if p == nil || p.Name != c.armed[slot].name {
		return false
	}
	select {
	case <-p.Done():
		return false
	default:
		return true
	}
}

// kill SIGKILLs a consumer, slot's unless target moves it.
func (c *consumers) kill(slot int) string { return c.Kill(c.target(slot)) }

// target returns slot, or the next slot along if slot still runs an armed
// consumer that has not reached its step: replacing it would take away its
// chance to die there (it may have spent its time waiting out a Postgres
// restart). If every slot is so armed, slot itself.
func (c *consumers) target(slot int) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := range c.size {
		if s := (slot + i) % c.size; !c.waiting(s) {
			return s
		}
	}
	return slot
}

// stop drains the fleet with SIGTERM and returns the consumers that did not
// exit cleanly. Two exits are not failed drains: an armed consumer that
// reached its step while it drained (a crash), and a replacement that got
// the SIGTERM before it had set up its signal handling (it had not begun
// to consume, so it held nothing to drain).
func (c *consumers) stop(timeout time.Duration) []string {
	var bad []string
	for _, e := range c.Stop(timeout) {
		if _, crashed := e.Proc.CrashedAt(); crashed || !e.Proc.LogContains("msg=consuming") {
			continue
		}
		bad = append(bad, fmt.Sprintf("%s: %v", e.Proc.Name, e.Err))
	}
	return bad
}

func (c *consumers) crashRecords() []CrashRecord {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]CrashRecord(nil), c.crashes...)
}
