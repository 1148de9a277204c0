package testenv

import (
	"context"
	"errors"
	"net/url"
	"os/exec"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/internal/sandbox"
)

// PostgresServer is a PostgreSQL cluster owned by one test, on its own port,
// so the test can stop and restart it without touching the shared server.
type PostgresServer struct {
	*sandbox.Postgres
	t testing.TB
}

// StartPostgres creates and starts a throwaway cluster (trust auth, fsync
// off), removed at the end of the test.
func StartPostgres(t testing.TB) *PostgresServer {
	t.Helper()
	s, err := sandbox.StartPostgres("")
	if errors.Is(err, sandbox.ErrNoInitdb) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Remove)
	return &PostgresServer{Postgres: s, t: t}
}

// Start starts the cluster again after Stop.
func (s *PostgresServer) Start() {
	s.t.Helper()
	if err := s.Postgres.Start(); err != nil {
		s.t.Fatal(err)
	}
}

// Stop shuts the cluster down at once (mode immediate, like a crash).
func (s *PostgresServer) Stop() {
	s.t.Helper()
	if err := s.Postgres.Stop(); err != nil {
		s.t.Fatal(err)
	}
}

// PostgresTool returns the path of an installed PostgreSQL program
// (pg_dump, pg_restore…) of the sandbox clusters' version, or skips the
// test when there is none.
func PostgresTool(t testing.TB, name string) string {
	t.Helper()
	p, err := sandbox.Tool(name)
	if errors.Is(err, sandbox.ErrNoInitdb) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// RunPostgresTool runs an installed PostgreSQL program (PostgresTool's
// name) with args, and fails the test with its output if it fails.
func RunPostgresTool(t testing.TB, name string, args ...string) {
	t.Helper()
	out, err := exec.Command(PostgresTool(t, name), args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", name, err, out)
	}
}

// Database creates a database of the test's own on the shared server and
// returns its URL, and recreate, which drops it (closing its sessions) and
// creates it again empty, as a restore into a re-created database starts.
// It is dropped at the end of the test.
func Database(t testing.TB) (dbURL string, recreate func()) {
	t.Helper()
	ctx := context.Background()
	admin, err := pgx.Connect(ctx, DatabaseURL())
	if err != nil {
		t.Fatal(err)
	}
	name := "idem_" + Name(t)
	do := func(sql string) error { _, err := admin.Exec(context.Background(), sql); return err }
	if err := do("CREATE DATABASE " + name); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := do("DROP DATABASE IF EXISTS " + name + " WITH (FORCE)"); err != nil {
			t.Logf("testenv: drop database %s: %v", name, err)
		}
		admin.Close(context.Background())
	})
	u, err := url.Parse(DatabaseURL())
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	return u.String(), func() {
		t.Helper()
		for _, sql := range []string{"DROP DATABASE " + name + " WITH (FORCE)", "CREATE DATABASE " + name} {
			if err := do(sql); err != nil {
				t.Fatal(err)
			}
		}
	}
}
