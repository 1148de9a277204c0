package fleet

import (
	"sync"
	"time"
)

// GroupConfig describes a Group.
type GroupConfig struct {
	// Size is how many processes the group keeps running.
	Size int
	// Spec returns the spec of the next process in slot; gen counts every
	// process the group has started, so names can be unique.
	Spec func(slot, gen int) Spec
	// RestartDelay is how long a supervisor waits before a replacement.
	RestartDelay time.Duration
	// OnExit, if set, is called when a process exits before the group
	// stops; armed says it was started with extra environment. It returns
	// false to leave the slot empty.
	OnExit func(p *Proc, armed bool) (restart bool)
}

// Group keeps Size processes running, as a process supervisor would: one
// that exits, killed or crashed, is replaced after RestartDelay. Each
// replacement is a new process with its own name, log and stats file.
type Group struct {
	cfg GroupConfig

	mu       sync.Mutex
	live     []*Proc // by slot; nil while a slot is being replaced
	all      []*Proc
	gen      int
	stopping bool
	restarts int
	wg       sync.WaitGroup
}

// StartGroup starts the group's processes; armed gives some slots extra
// environment (a crash point, say) for their first process only.
func StartGroup(cfg GroupConfig, armed map[int][]string) (*Group, error) {
	g := &Group{cfg: cfg, live: make([]*Proc, cfg.Size)}
	g.mu.Lock()
	defer g.mu.Unlock()
	for i := range cfg.Size {
		if err := g.spawn(i, armed[i]); err != nil {
			g.stopping = true
			for _, p := range g.all {
				p.Kill()
			}
			return nil, err
		}
	}
	return g, nil
}

// spawn starts slot i's next process. Call with g.mu held.
func (g *Group) spawn(i int, extraEnv []string) error {
	s := g.cfg.Spec(i, g.gen)
	s.Env = append(append([]string{}, s.Env...), extraEnv...)
	p, err := Start(s)
	if err != nil {
		return err
	}
	g.gen++
	g.live[i] = p
	g.all = append(g.all, p)
	g.wg.Go(func() { g.supervise(i, p, extraEnv != nil) })
	return nil
}

// supervise replaces p when it exits, unless the group is stopping, p was
// replaced on purpose, or OnExit says no. A replacement is never armed.
func (g *Group) supervise(i int, p *Proc, armed bool) {
	<-p.Done()
	g.mu.Lock()
	stopping := g.stopping
	g.mu.Unlock()
	if stopping {
		return
	}
	if g.cfg.OnExit != nil && !g.cfg.OnExit(p, armed) {
		return
	}
	time.Sleep(g.cfg.RestartDelay)
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.stopping || g.live[i] != p {
		return
	}
	g.restarts++
	if err := g.spawn(i, nil); err != nil {
		g.live[i] = nil
	}
}

// Kill SIGKILLs slot i's process, which its supervisor then replaces, and
// returns its name.
func (g *Group) Kill(i int) string {
	g.mu.Lock()
	p := g.live[i]
	g.mu.Unlock()
	if p == nil {
		return ""
	}
	p.Kill()
	return p.Name
}

// Replace kills slot i's process and starts one with extra environment in
// its place at once; it returns the new process's name.
func (g *Group) Replace(i int, extraEnv []string) (string, error) {
	g.mu.Lock()
	old := g.live[i]
	g.live[i] = nil // its supervisor must not replace it too
	g.mu.Unlock()
	if old != nil {
		old.Kill()
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.stopping {
		return "", nil
	}
	if err := g.spawn(i, extraEnv); err != nil {
		return "", err
	}
	return g.live[i].Name, nil
}

// Current returns slot i's process now, or nil between a death and its
// replacement.
func (g *Group) Current(i int) *Proc {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.live[i]
}

// Alive counts the processes running now.
func (g *Group) Alive() int {
	n := 0
	for _, p := range g.current() {
		select {
		case <-p.Done():
		default:
			n++
		}
	}
	return n
}

func (g *Group) current() []*Proc {
	g.mu.Lock()
	defer g.mu.Unlock()
	var out []*Proc
	for _, p := range g.live {
		if p != nil {
			out = append(out, p)
		}
	}
	return out
}

// Procs returns every process the group has started.
func (g *Group) Procs() []*Proc {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]*Proc(nil), g.all...)
}

// Restarts counts the replacements made by supervisors.
func (g *Group) Restarts() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.restarts
}

// StopError is a process that did not exit cleanly on SIGTERM.
type StopError struct {
	Proc *Proc
	Err  error
}

// Stop ends supervision and sends SIGTERM to every running process at once,
// killing those still running after timeout. It returns those that did not
// exit cleanly.
func (g *Group) Stop(timeout time.Duration) []StopError {
	g.mu.Lock()
	g.stopping = true
	g.mu.Unlock()
	var mu sync.Mutex
	var bad []StopError
	var wg sync.WaitGroup
	for _, p := range g.current() {
		wg.Go(func() {
			if err := p.Stop(timeout); err != nil {
				mu.Lock()
				bad = append(bad, StopError{p, err})
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	g.wg.Wait()
	return bad
}

// KillAll ends supervision and kills every process at once.
func (g *Group) KillAll() {
	g.mu.Lock()
	g.stopping = true
	all := append([]*Proc(nil), g.all...)
	g.mu.Unlock()
	for _, p := range all {
		p.Kill()
	}
	g.wg.Wait()
}
