package chaos

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/fleet"
	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/testenv"
)

// env is one test's isolated slice of the services, as test/e2e's: a
// schema, a queue name and a Redis key prefix of its own, and the idem
// processes it started, killed at the end.
type env struct {
	t       *testing.T
	pool    *pgxpool.Pool
	appName string // application_name of the consumers' Postgres sessions
	queue   string
	dir     string
	vars    []string
	procs   []*fleet.Proc
}

// newEnvOn gives the test its own schema on the Postgres server at
// databaseURL, its own queue on amqpURL and its own key prefix on the Redis
// at redisURL, and the consumer settings test/e2e's consumers run with.
func newEnvOn(t *testing.T, redisURL, amqpURL, databaseURL string) *env {
	t.Helper()
	pool, dbURL := testenv.SchemaOn(t, databaseURL, payments.Migrations)
	e := &env{t: t, pool: pool, queue: testenv.Queue(t, amqpURL), dir: t.TempDir()}
	e.appName = "idem_" + testenv.Name(t)
	dbURL = testenv.WithParam(dbURL, "application_name", e.appName)
	e.vars = testenv.ConsumerVars(dbURL, amqpURL, redisURL, e.queue, testenv.Name(t))
	t.Cleanup(func() {
		for _, p := range e.procs {
			p.Kill()
		}
		if t.Failed() {
			testenv.DumpLogs(t, e.procs)
		}
	})
	return e
}

// idem runs an idem subcommand to completion and returns its output.
func (e *env) idem(args ...string) (string, error) {
	cmd, out := e.command(context.Background(), nil, args...)
	err := cmd.Run()
	return out.String(), err
}

// command prepares an idem subcommand with the test's environment plus
// extraEnv; its stdout and stderr go to out.
func (e *env) command(ctx context.Context, extraEnv []string, args ...string) (cmd *exec.Cmd, out *bytes.Buffer) {
	cmd = exec.CommandContext(ctx, idemBin, args...)
	cmd.Env = append(append(os.Environ(), e.vars...), extraEnv...)
	out = &bytes.Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	return cmd, out
}

// result is how an idem command ended.
type result struct {
	code int // exit status
	out  string
}

// run runs an idem subcommand with extra environment and returns how it
// ended. A command still running after a minute fails the test: every
// command run this way must end by itself.
func (e *env) run(extraEnv []string, args ...string) result {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd, out := e.command(ctx, extraEnv, args...)
	err := cmd.Run()
	require.NoError(e.t, ctx.Err(), "idem %v did not end by itself:\n%s", args, out.String())
	return result{code: testenv.ExitCode(err), out: out.String()}
}

// waitConsuming waits until p logged that it consumes, or exited.
func (e *env) waitConsuming(p *fleet.Proc) {
	e.t.Helper()
	testenv.WaitConsuming(e.t, p)
}
