package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// Redis is a redis-server of the caller's own, without persistence.
type Redis struct {
	Port int
	// Args are added to the server's command line (cluster mode, say).
	Args []string
	dir  string
	cmd  *exec.Cmd
	done chan struct{}
}

// StartRedis starts a redis-server on a free port with its files in dir.
func StartRedis(dir string) (*Redis, error) {
	if _, err := exec.LookPath("redis-server"); err != nil {
		return nil, fmt.Errorf("sandbox: redis-server not installed: %w", err)
	}
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	s := &Redis{Port: port, dir: dir}
	return s, s.Start()
}

// URL is the server's redis:// URL.
func (s *Redis) URL() string { return fmt.Sprintf("redis://127.0.0.1:%d/0", s.Port) }

// Client returns a new client for the server.
func (s *Redis) Client() *redis.Client {
	return redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", s.Port), ContextTimeoutEnabled: true})
}

// Start (re)starts the server on its port and waits until it answers PING.
// DEBUG is enabled so that Slow can make it sleep.
func (s *Redis) Start() error {
	s.cmd = exec.Command("redis-server", "--port", strconv.Itoa(s.Port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", s.dir, "--enable-debug-command", "local",
		"--logfile", filepath.Join(s.dir, "redis.log"))
	s.cmd.Args = append(s.cmd.Args, s.Args...)
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := s.cmd.Start(); err != nil {
		return fmt.Errorf("sandbox: start redis-server: %w", err)
	}
	s.done = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) { _ = cmd.Wait(); close(done) }(s.cmd, s.done)
	rdb := s.Client()
	defer rdb.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := rdb.Ping(ctx).Err()
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(s.dir, "redis.log"))
			return fmt.Errorf("sandbox: redis-server on %d did not answer: %v\n%s", s.Port, err, b)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Signal sends sig to the server (SIGSTOP and SIGCONT freeze and thaw it).
func (s *Redis) Signal(sig syscall.Signal) error {
	if s.cmd == nil || s.cmd.Process == nil {
		return errors.New("sandbox: redis-server not started")
	}
	return s.cmd.Process.Signal(sig)
}

// Kill SIGKILLs the server, losing every key, and waits for it to exit.
func (s *Redis) Kill() {
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	<-s.done
}

// Do runs one command on a fresh connection.
func (s *Redis) Do(ctx context.Context, args ...any) error {
	rdb := s.Client()
	defer rdb.Close()
	if err := rdb.Do(ctx, args...).Err(); err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("sandbox: redis %v: %w", args, err)
	}
	return nil
}

// Pause stops the server from answering clients for d (CLIENT PAUSE ALL):
// commands queue up and run when the pause ends.
func (s *Redis) Pause(ctx context.Context, d time.Duration) error {
	return s.Do(ctx, "CLIENT", "PAUSE", d.Milliseconds(), "ALL")
}

// Slow makes the server answer late until ctx ends: it sleeps lag at a time
// (DEBUG SLEEP blocks every client) with a short gap between sleeps, so
// most commands wait up to lag.
func (s *Redis) Slow(ctx context.Context, lag time.Duration) error {
	rdb := s.Client()
	defer rdb.Close()
	for ctx.Err() == nil {
		cctx, cancel := context.WithTimeout(context.Background(), lag+time.Second)
		err := rdb.Do(cctx, "DEBUG", "SLEEP", fmt.Sprintf("%.3f", lag.Seconds())).Err()
		cancel()
		if err != nil {
			return fmt.Errorf("sandbox: redis DEBUG SLEEP: %w", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(lag / 10):
		}
	}
	return nil
}

// Evict caps the server's memory at what it uses now plus headroom, with an
// evicting policy, so that it stores new keys by evicting others, until
// ctx ends; then it lifts the cap. (A cap below the server's own baseline
// would refuse writes with OOM instead of evicting.)
func (s *Redis) Evict(ctx context.Context, headroom int64, policy string) error {
	rdb := s.Client()
	defer rdb.Close()
	info, err := rdb.Info(ctx, "memory").Result()
	if err != nil {
		return fmt.Errorf("sandbox: redis INFO memory: %w", err)
	}
	var used int64
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "used_memory:"); ok {
			used, _ = strconv.ParseInt(v, 10, 64)
		}
	}
	if used == 0 {
		return errors.New("sandbox: redis INFO memory has no used_memory")
	}
	set := func(c context.Context, k string, v any) error {
		if err := rdb.ConfigSet(c, k, fmt.Sprint(v)).Err(); err != nil {
			return fmt.Errorf("sandbox: redis CONFIG SET %s: %w", k, err)
		}
		return nil
	}
	if err := set(ctx, "maxmemory-policy", policy); err != nil {
		return err
	}
	if err := set(ctx, "maxmemory", used+headroom); err != nil {
		return err
	}
	<-ctx.Done()
	rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return set(rctx, "maxmemory", 0)
}
