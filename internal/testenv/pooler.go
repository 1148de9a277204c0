package testenv

import (
	"errors"
	"net/url"
	"os"
	"strconv"
	"testing"

	"github.com/idemhq/idem/internal/sandbox"
)

// PgBouncer starts a PgBouncer of the test's own in front of the shared
// PostgreSQL (transaction pooling unless o says otherwise) and stops it
// when the test ends, logging its last lines if the test failed. Without
// pgbouncer installed the test skips, or fails under CI (.ci/services.sh
// installs it).
func PgBouncer(t testing.TB, o sandbox.PgBouncerOptions) *sandbox.PgBouncer {
	t.Helper()
	u, err := url.Parse(DatabaseURL())
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	port, err := strconv.Atoi(u.Port())
	if err != nil {
		t.Fatalf("testenv: DATABASE_URL has no port: %v", err)
	}
	// Its directory is not t.TempDir(): the postgres user it runs as
	// cannot enter that.
	b, err := sandbox.StartPgBouncer("", u.Hostname(), port, o)
	if errors.Is(err, sandbox.ErrNoPgBouncer) && os.Getenv("CI") == "" {
		t.Skip("pgbouncer is not installed (.ci/services.sh installs it)")
	}
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			log := b.Log()
			if len(log) > 4000 {
				log = log[len(log)-4000:]
			}
			t.Logf("--- pgbouncer log:\n%s", log)
		}
		b.Close()
	})
	return b
}
