package testenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// PostgresServer is a PostgreSQL cluster owned by one test, on its own port,
// so the test can stop and restart it without touching the shared server.
// initdb and pg_ctl refuse to run as root, so as root they run as the
// postgres user.
type PostgresServer struct {
	t    testing.TB
	Port int
	dir  string
	bin  string
}

// StartPostgres creates and starts a throwaway cluster (trust auth, fsync off).
func StartPostgres(t testing.TB) *PostgresServer {
	t.Helper()
	bin := pgBinDir()
	if bin == "" {
		t.Skip("initdb not installed")
	}
	dir, err := os.MkdirTemp("", "idem-pg-")
	if err != nil {
		t.Fatal(err)
	}
	s := &PostgresServer{t: t, Port: FreePort(t), dir: dir, bin: bin}
	t.Cleanup(func() {
		_ = s.ctl("stop", "-m", "immediate")
		os.RemoveAll(dir)
	})
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Skip("running as root and there is no postgres user for initdb")
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			t.Fatal(err)
		}
	}
	if out, err := s.run(filepath.Join(bin, "initdb"), "-D", s.data(), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync").CombinedOutput(); err != nil {
		t.Fatalf("testenv: initdb: %v\n%s", err, out)
	}
	s.Start()
	return s
}

// URL is a DATABASE_URL for the cluster's postgres database.
func (s *PostgresServer) URL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.Port)
}

// Start starts the cluster and waits until it accepts connections.
func (s *PostgresServer) Start() {
	s.t.Helper()
	if err := s.ctl("start", "-w", "-t", "60", "-l", filepath.Join(s.dir, "log"),
		"-o", fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200", s.Port, s.dir)); err != nil {
		b, _ := os.ReadFile(filepath.Join(s.dir, "log"))
		s.t.Fatalf("testenv: start postgres: %v\n%s", err, b)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, s.URL())
	if err != nil {
		s.t.Fatalf("testenv: connect to started postgres: %v", err)
	}
	c.Close(ctx)
}

// Stop shuts the cluster down at once (mode immediate: like a crash, every
// session is cut and open transactions are lost).
func (s *PostgresServer) Stop() {
	s.t.Helper()
	if err := s.ctl("stop", "-m", "immediate", "-w"); err != nil {
		s.t.Fatalf("testenv: stop postgres: %v", err)
	}
}

func (s *PostgresServer) data() string { return filepath.Join(s.dir, "data") }

func (s *PostgresServer) ctl(args ...string) error {
	args = append([]string{"-D", s.data()}, args...)
	out, err := s.run(filepath.Join(s.bin, "pg_ctl"), args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%w: %s", err, out)
	}
	return nil
}

func (s *PostgresServer) run(name string, args ...string) *exec.Cmd {
	if os.Geteuid() == 0 {
		return exec.Command("runuser", append([]string{"-u", "postgres", "--", name}, args...)...)
	}
	return exec.Command(name, args...)
}

func pgBinDir() string {
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			return filepath.Dir(real)
		}
		return filepath.Dir(p)
	}
	matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
	if len(matches) == 0 {
		return ""
	}
	return filepath.Dir(matches[len(matches)-1])
}
