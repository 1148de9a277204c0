package sandbox

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisSentinel is a Redis master with one replica, watched by one Sentinel,
// all of the caller's own: a test can kill the master and watch the
// Sentinel promote the replica.
type RedisSentinel struct {
	Master, Replica *Redis
	// MasterName is the name the Sentinel monitors the master under.
	MasterName string
	port       int
	dir        string
	cmd        *exec.Cmd
	done       chan struct{}
}

// StartRedisSentinel starts the master, its replica and a Sentinel under
// dir, and waits until the Sentinel knows the master.
func StartRedisSentinel(dir string) (*RedisSentinel, error) {
	s := &RedisSentinel{MasterName: "idem", dir: dir}
	var err error
	if s.Master, err = StartRedis(mkdir(dir, "master")); err != nil {
		return nil, err
	}
	port, err := FreePort()
	if err != nil {
		s.Kill()
		return nil, err
	}
	s.Replica = &Redis{Port: port, dir: mkdir(dir, "replica"), Args: []string{"--replicaof", "127.0.0.1", strconv.Itoa(s.Master.Port)}}
	if err := s.Replica.Start(); err != nil {
		s.Kill()
		return nil, err
	}
	if s.port, err = FreePort(); err != nil {
		s.Kill()
		return nil, err
	}
	conf := filepath.Join(dir, "sentinel.conf")
	body := fmt.Sprintf("port %d\nbind 127.0.0.1\ndir %s\nsentinel monitor %s 127.0.0.1 %d 1\n"+
		"sentinel down-after-milliseconds %s 1000\nsentinel failover-timeout %s 3000\n",
		s.port, dir, s.MasterName, s.Master.Port, s.MasterName, s.MasterName)
	if err := os.WriteFile(conf, []byte(body), 0o644); err != nil {
		s.Kill()
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	s.cmd = exec.Command("redis-server", conf, "--sentinel", "--logfile", filepath.Join(dir, "sentinel.log"))
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := s.cmd.Start(); err != nil {
		s.Kill()
		return nil, fmt.Errorf("sandbox: start sentinel: %w", err)
	}
	s.done = make(chan struct{})
	go func() { _ = s.cmd.Wait(); close(s.done) }()
	if _, err := s.MasterAddr(10 * time.Second); err != nil {
		s.Kill()
		return nil, err
	}
	return s, nil
}

func mkdir(parent, name string) string {
	d := filepath.Join(parent, name)
	_ = os.MkdirAll(d, 0o755)
	return d
}

// URL is a REDIS_URL for redis.mode sentinel.
func (s *RedisSentinel) URL() string {
	return fmt.Sprintf("redis://127.0.0.1:%d?master_name=%s", s.port, s.MasterName)
}

// MasterAddr asks the Sentinel for the master's address, waiting up to
// timeout for it to know one.
func (s *RedisSentinel) MasterAddr(timeout time.Duration) (string, error) {
	sc := redis.NewSentinelClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", s.port)})
	defer sc.Close()
	deadline := time.Now().Add(timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		addr, err := sc.GetMasterAddrByName(ctx, s.MasterName).Result()
		cancel()
		if err == nil && len(addr) == 2 {
			return addr[0] + ":" + addr[1], nil
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("sandbox: sentinel does not know master %s: %v", s.MasterName, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Kill SIGKILLs the Sentinel and both servers.
func (s *RedisSentinel) Kill() {
	if s.cmd != nil && s.cmd.Process != nil {
		_ = s.cmd.Process.Kill()
		<-s.done
	}
	for _, r := range []*Redis{s.Master, s.Replica} {
		if r != nil {
			r.Kill()
		}
	}
}
