package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
)

// secret is the password in every form below; no output may hold any of it.
const secret = "Zq7sentinelPW"

// TestNoSecretIsPrinted runs config, consume, migrate, publish and verify
// with a password in every form each connection setting can take, parseable
// or not, and searches all they print for it.
func TestNoSecretIsPrinted(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	manifest := filepath.Join(e.dir, "m.json")
	require.NoError(t, os.WriteFile(manifest, []byte(`{"runId":"r","queue":"q","events":[]}`), 0o644))
	closed := testenv.FreePort(t)
	pg := "127.0.0.1:5432"
	noDB := "idem_no_such_db"
	forms := map[string][]string{
		"DATABASE_URL": {
			"postgres://postgres:" + secret + "@" + pg + "/" + noDB + "?sslmode=disable",
			"postgres://postgres:" + secret + "%zz@" + pg + "/" + noDB,
			"postgres://postgres:" + secret + "/x@" + pg + "/" + noDB,
			"postgres://postgres:" + secret + "#x@" + pg + "/" + noDB,
			"postgres://postgres:" + secret + "@127.0.0.1:port/" + noDB,
			"postgres://" + pg + "/" + noDB + "?user=postgres&password=" + secret + "&sslmode=disable",
			"host=127.0.0.1 user=postgres password=" + secret + " dbname=" + noDB + " sslmode=disable",
			"host=127.0.0.1 user=postgres password='" + secret + " x' dbname=" + noDB + " sslmode=disable",
		},
		"AMQP_URL": {
			"amqp://guest:" + secret + "@127.0.0.1:5672/",
			"amqp://guest:" + secret + "%zz@127.0.0.1:5672/",
			"amqp://guest:" + secret + "/x@127.0.0.1:5672/",
			"amqp://guest:" + secret + "#x@127.0.0.1:5672/",
			"amqp://guest:" + secret + "@127.0.0.1:port/",
			"amqp://guest:guest@127.0.0.1:5672/?password=" + secret,
		},
		"REDIS_URL": {
			fmt.Sprintf("redis://:%s@127.0.0.1:%d/0", secret, closed),
			fmt.Sprintf("redis://u:%s%%zz@127.0.0.1:%d/0", secret, closed),
			fmt.Sprintf("redis://u:%s/x@127.0.0.1:%d/0", secret, closed),
			fmt.Sprintf("redis://u:%s#x@127.0.0.1:%d/0", secret, closed),
			"redis://u:" + secret + "@127.0.0.1:port/0",
			fmt.Sprintf("redis://127.0.0.1:%d/0?password=%s", closed, secret),
		},
	}
	commands := [][]string{
		{"config"},
		{"consume"},
		{"migrate"},
		{"publish", "--count", "1", "--quiet"},
		{"verify", "--manifest", manifest},
	}
	for v, values := range forms {
		for i, value := range values {
			t.Run(fmt.Sprintf("%s/%d", v, i), func(t *testing.T) {
				var wg sync.WaitGroup
				for _, args := range commands {
					wg.Go(func() {
						out := e.runBriefly(t, []string{v + "=" + value, "IDEM_CONSUMER_STARTUP_TIMEOUT=2s"}, args...)
						if strings.Contains(out, "Zq7sentinel") {
							t.Errorf("idem %s with %s=<form %d> printed the password:\n%s", args[0], v, i, out)
						}
					})
				}
				wg.Wait()
			})
		}
	}
}

// runBriefly runs an idem command and, if it is still running after two
// seconds (a consumer that started), stops it with SIGTERM. It returns all
// the command printed.
func (e *env) runBriefly(t *testing.T, extraEnv []string, args ...string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	cmd, out := e.command(ctx, extraEnv, args...)
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 30 * time.Second
	_ = cmd.Run()
	return out.String()
}
