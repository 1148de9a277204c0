package testenv

import (
	"errors"
	"testing"

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
