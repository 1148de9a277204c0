package testenv

import (
	"errors"
	"os/exec"
	"testing"

	"github.com/idemhq/idem/internal/sandbox"
)

// RedisServer is a redis-server owned by one test, on its own port, so the
// test can kill, restart, pause and flush it without touching the shared one.
type RedisServer struct {
	*sandbox.Redis
	t testing.TB
}

// StartRedis starts a private redis-server with no persistence; it is
// killed at the end of the test.
func StartRedis(t testing.TB) *RedisServer {
	t.Helper()
	s, err := sandbox.StartRedis(t.TempDir())
	if err != nil {
		if errors.Is(err, exec.ErrNotFound) {
			t.Skip(err)
		}
		t.Fatal(err)
	}
	t.Cleanup(s.Kill)
	return &RedisServer{Redis: s, t: t}
}

// Start restarts the server after Kill.
func (s *RedisServer) Start() {
	s.t.Helper()
	if err := s.Redis.Start(); err != nil {
		s.t.Fatal(err)
	}
}

// FreePort returns a loopback TCP port that was free a moment ago.
func FreePort(t testing.TB) int {
	t.Helper()
	p, err := sandbox.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// StartRedisCluster starts a test-owned Redis Cluster (three masters, one
// replica each), killed at the end of the test.
func StartRedisCluster(t testing.TB) *sandbox.RedisCluster {
	t.Helper()
	c, err := sandbox.StartRedisCluster(t.TempDir(), 3)
	if err != nil {
		if errors.Is(err, exec.ErrNotFound) {
			t.Skip(err)
		}
		t.Fatal(err)
	}
	t.Cleanup(c.Kill)
	return c
}
