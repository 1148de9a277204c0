// Package fleet starts and stops `idem consume` processes (or lab workers):
// the demo's and chaos runs' fleets and the crash tests' victims. Each
// process logs to its own file.
package fleet

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/idemhq/idem/internal/crashpoint"
)

// Proc is one running consumer process.
type Proc struct {
	Name      string
	LogPath   string
	StatsPath string
	cmd       *exec.Cmd
	stdin     io.WriteCloser // with Spec.Handshake
	done      chan struct{}
	err       error
}

// Spec says how to start a consumer.
type Spec struct {
	Bin string // the idem binary
	// Command is the idem subcommand; it must take --name and
	// --stats-file. Defaults to "consume".
	Command string
	Name    string   // connection name, also names the log and stats files
	Dir     string   // where logs and stats go
	Env     []string // appended to this process's environment
	Args    []string // extra arguments after "consume"
	// Handshake: the process prints "ready" on stdout once set up and
	// waits for a line on stdin before it starts (idem-lab bench's
	// workers); Start returns once it is ready, and Release lets it go.
	Handshake bool
}

// Start launches `idem consume` as described by s.
func Start(s Spec) (*Proc, error) {
	p := &Proc{
		Name:      s.Name,
		LogPath:   filepath.Join(s.Dir, s.Name+".log"),
		StatsPath: filepath.Join(s.Dir, s.Name+".stats.json"),
		done:      make(chan struct{}),
	}
	logf, err := os.Create(p.LogPath)
	if err != nil {
		return nil, err
	}
	if s.Command == "" {
		s.Command = "consume"
	}
	args := append([]string{s.Command, "--name", s.Name, "--stats-file", p.StatsPath}, s.Args...)
	p.cmd = exec.Command(s.Bin, args...)
	p.cmd.Env = append(os.Environ(), s.Env...)
	p.cmd.Stderr = logf
	var ready *bufio.Reader
	if !s.Handshake {
		p.cmd.Stdout = logf
	} else {
		out, err := p.cmd.StdoutPipe()
		if err != nil {
			logf.Close()
			return nil, err
		}
		ready = bufio.NewReader(out)
		if p.stdin, err = p.cmd.StdinPipe(); err != nil {
			logf.Close()
			return nil, err
		}
	}
	// A consumer must not outlive the test or demo that started it.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", s.Name, err)
	}
	if ready != nil {
		// Read before Wait runs: Wait closes the pipe.
		if line, err := ready.ReadString('\n'); err != nil || strings.TrimSpace(line) != "ready" {
			_ = p.cmd.Process.Kill()
			_ = p.cmd.Wait()
			logf.Close()
			return nil, fmt.Errorf("%s did not get ready (see %s): %q %v", s.Name, p.LogPath, line, err)
		}
	}
	go func() {
		p.err = p.cmd.Wait()
		logf.Close()
		close(p.done)
	}()
	return p, nil
}

// Release lets a process started with Spec.Handshake begin.
func (p *Proc) Release() error {
	_, err := io.WriteString(p.stdin, "go\n")
	return err
}

// PID is the process's ID.
func (p *Proc) PID() int { return p.cmd.Process.Pid }

// Done is closed when the process has exited.
func (p *Proc) Done() <-chan struct{} { return p.done }

// Killed reports whether the process died of SIGKILL. Call after Done.
func (p *Proc) Killed() bool {
	var ee *exec.ExitError
	if !errors.As(p.err, &ee) {
		return false
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// Err is the process's exit error (nil for exit 0). Call after Done.
func (p *Proc) Err() error { return p.err }

// Kill sends SIGKILL and waits for the exit.
func (p *Proc) Kill() {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// Stop sends SIGTERM and waits up to timeout for a clean exit, then kills.
// It returns the exit error of a process that did not exit cleanly.
func (p *Proc) Stop(timeout time.Duration) error {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return p.err
	case <-time.After(timeout):
		p.Kill()
		return fmt.Errorf("%s did not stop within %s and was killed", p.Name, timeout)
	}
}

// Stats reads the last outcome counts the process wrote: final after a
// clean exit, at most a second old after a kill.
func (p *Proc) Stats() (map[string]int64, error) {
	b, err := os.ReadFile(p.StatsPath)
	if err != nil {
		return nil, err
	}
	var m map[string]int64
	return m, json.Unmarshal(b, &m)
}

// LogContains reports whether the process's log holds s, e.g. the
// consumer's "msg=consuming" once it is up.
func (p *Proc) LogContains(s string) bool {
	b, err := os.ReadFile(p.LogPath)
	return err == nil && strings.Contains(string(b), s)
}

// CrashedAt returns the step a process killed itself at, read from its log.
// Call after Done.
func (p *Proc) CrashedAt() (string, bool) {
	if !p.Killed() {
		return "", false
	}
	b, err := os.ReadFile(p.LogPath)
	if err != nil {
		return "", false
	}
	i := strings.LastIndex(string(b), crashpoint.Marker)
	if i < 0 {
		return "", false
	}
	step, _, _ := strings.Cut(string(b[i+len(crashpoint.Marker):]), "\n")
	return strings.TrimSpace(step), true
}
