package chaos

import (
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/idemhq/idem/internal/crashpoint"
	"github.com/idemhq/idem/internal/fleet"
)

// slots keeps Consumers processes running: a consumer that exits, killed
// or crashed at its armed step, is replaced after a short pause, as a
// process supervisor would. Every generation of a slot has its own name,
// log and stats file.
type slots struct {
	bin, dir, prefix string
	env              []string
	args             []string
	t0               time.Time

	mu       sync.Mutex
	live     []*fleet.Proc
	all      []*fleet.Proc
	gen      int
	stopping bool
	restarts int
	crashes  []CrashRecord // armed crash points that fired
	wg       sync.WaitGroup
}

// CrashRecord is one consumer that died of its armed crash point.
type CrashRecord struct {
	Consumer string  `json:"consumer"`
	Step     string  `json:"step"`
	At       float64 `json:"at"` // seconds from the start
}

func (s *slots) start(n int) error {
	s.live = make([]*fleet.Proc, n)
	for i := range n {
		if err := s.spawn(i, nil); err != nil {
			return err
		}
	}
	return nil
}

// spawn starts slot i's next generation. Call with s.mu held or before the
// supervisors run.
func (s *slots) spawn(i int, extraEnv []string) error {
	name := fmt.Sprintf("%s%d-%d", s.prefix, i, s.gen)
	s.gen++
	p, err := fleet.Start(fleet.Spec{Bin: s.bin, Name: name, Dir: s.dir,
		Env: append(append([]string{}, s.env...), extraEnv...), Args: s.args})
	if err != nil {
		return err
	}
	s.live[i] = p
	s.all = append(s.all, p)
	s.wg.Add(1)
	go s.supervise(i, p, extraEnv != nil)
	return nil
}

// supervise waits for p to exit and, unless the run is stopping, replaces
// it. A replacement is never armed.
func (s *slots) supervise(i int, p *fleet.Proc, armed bool) {
	defer s.wg.Done()
	<-p.Done()
	if armed {
		if step, ok := p.CrashedAt(); ok {
			s.mu.Lock()
			s.crashes = append(s.crashes, CrashRecord{Consumer: p.Name, Step: step, At: time.Since(s.t0).Seconds()})
			s.mu.Unlock()
		}
	}
	time.Sleep(300 * time.Millisecond) // a supervisor's restart delay
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopping || s.live[i] != p {
		return
	}
	s.restarts++
	if err := s.spawn(i, nil); err != nil {
		fmt.Fprintf(os.Stderr, "chaos: restart consumer %d: %v\n", i, err)
	}
}

// kill SIGKILLs slot i's consumer; its supervisor restarts it.
func (s *slots) kill(i int) string {
	s.mu.Lock()
	p := s.live[i]
	s.mu.Unlock()
	p.Kill()
	return p.Name
}

// arm replaces slot i's consumer with one that SIGKILLs itself at step
// after passing it after times.
func (s *slots) arm(i int, step string, after int) (string, error) {
	s.mu.Lock()
	old := s.live[i]
	s.live[i] = nil // the old supervisor must not replace it
	s.mu.Unlock()
	old.Kill()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopping {
		return old.Name, nil
	}
	err := s.spawn(i, []string{crashpoint.EnvAt + "=" + step, crashpoint.EnvAfter + "=" + strconv.Itoa(after)})
	return s.live[i].Name, err
}

// alive counts running consumers.
func (s *slots) alive() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, p := range s.live {
		if p == nil {
			continue
		}
		select {
		case <-p.Done():
		default:
			n++
		}
	}
	return n
}

// procs returns every consumer started so far.
func (s *slots) procs() []*fleet.Proc {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*fleet.Proc(nil), s.all...)
}

// stop ends supervision and sends SIGTERM to every live consumer; it
// returns the names of those that did not drain and exit cleanly.
func (s *slots) stop(timeout time.Duration) []string {
	s.mu.Lock()
	s.stopping = true
	live := append([]*fleet.Proc(nil), s.live...)
	s.mu.Unlock()
	var mu sync.Mutex
	var bad []string
	var wg sync.WaitGroup
	for _, p := range live {
		if p == nil {
			continue
		}
		wg.Go(func() {
			err := p.Stop(timeout)
			if _, crashed := p.CrashedAt(); err == nil || crashed {
				return // an armed consumer may reach its step while it drains
			}
			mu.Lock()
			bad = append(bad, fmt.Sprintf("%s: %v", p.Name, err))
			mu.Unlock()
		})
	}
	wg.Wait()
	s.wg.Wait()
	return bad
}

// killAll is the error path: every consumer dies at once.
func (s *slots) killAll() {
	s.mu.Lock()
	s.stopping = true
	live := append([]*fleet.Proc(nil), s.all...)
	s.mu.Unlock()
	for _, p := range live {
		p.Kill()
	}
	s.wg.Wait()
}
