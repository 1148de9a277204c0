// Package e2e runs the idem binary against the real RabbitMQ, PostgreSQL and
// Redis: fleets of `idem consume` processes, killed with SIGKILL at named
// points, with Redis killed and flushed under them.
package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/crashpoint"
	"github.com/idemhq/idem/internal/fleet"
	"github.com/idemhq/idem/internal/loadgen"
	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/verify"
)

// idemBin is the shipped binary (cmd/idem); labBin is the harness
// (cmd/idem-lab): demo, chaos, lab, bench, and a consume crash points arm.
var idemBin, labBin string

func TestMain(m *testing.M) { testenv.MainWithBinaries(m, raceEnabled, &idemBin, &labBin) }

// env is one test's isolated slice of the services.
type env struct {
	t       *testing.T
	pool    *pgxpool.Pool
	amqpURL string
	appName string // application_name of the consumers' Postgres sessions
	// brokerLimit is the queue's x-delivery-limit; publishRaw declares the
	// queue with it, so it must match IDEM_CONSUMER_BROKER_DELIVERY_LIMIT.
	brokerLimit int
	queue       string
	dir         string
	vars        []string
	procs       []*fleet.Proc
	nextID      int
}

// newEnv gives the test its own schema, queue and Redis key prefix. redisURL
// may name a test-owned Redis and amqpURL a test-owned vhost; empty means the
// shared ones.
func newEnv(t *testing.T, redisURL, amqpURL string) *env {
	t.Helper()
	return newEnvOn(t, redisURL, amqpURL, testenv.DatabaseURL())
}

// newEnvOn is newEnv with the schema on the Postgres server at databaseURL.
func newEnvOn(t *testing.T, redisURL, amqpURL, databaseURL string) *env {
	t.Helper()
	// test/chaos runs beside this package; its cluster chaos run needs the
	// machine to itself (testenv.Exclusive).
	testenv.Shared(t)
	if amqpURL == "" {
		amqpURL = testenv.AMQPURL()
	}
	pool, dbURL := testenv.SchemaOn(t, databaseURL, payments.Migrations)
	e := &env{t: t, pool: pool, amqpURL: amqpURL, queue: testenv.Queue(t, amqpURL), dir: t.TempDir(),
		brokerLimit: 0}
	e.appName = "idem_" + testenv.Name(t)
	dbURL = testenv.WithParam(dbURL, "application_name", e.appName)
	prefix := testenv.Name(t)
	if redisURL == "" {
		_, p := testenv.Redis(t) // deletes the prefix's keys at the end
		redisURL, prefix = testenv.RedisURL(), p
	}
	e.vars = testenv.ConsumerVars(dbURL, amqpURL, redisURL, e.queue, prefix)
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
	command := ""
	if len(args) > 0 {
		command = args[0]
	}
	cmd = exec.CommandContext(ctx, binFor(command, append(append([]string{}, e.vars...), extraEnv...)), args...)
	cmd.Env = append(append(os.Environ(), e.vars...), extraEnv...)
	out = &bytes.Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	return cmd, out
}

// poisonLedger makes every payment of user_poison fail in the handler, as a
// handler that keeps failing would.
func (e *env) poisonLedger() {
	e.t.Helper()
	_, err := e.pool.Exec(context.Background(), `
		CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.user_id = 'user_poison' THEN RAISE EXCEPTION 'poisoned payment'; END IF;
			RETURN NEW;
		END $$;
		CREATE TRIGGER poison BEFORE INSERT ON payments_ledger FOR EACH ROW EXECUTE FUNCTION poison();`)
	require.NoError(e.t, err)
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

// publish sends count events plus dupRatio re-sends and returns the manifest.
func (e *env) publish(count int, dupRatio float64, extra ...string) loadgen.Manifest {
	e.t.Helper()
	path := filepath.Join(e.dir, fmt.Sprintf("manifest-%d.json", e.nextID))
	e.nextID++
	args := append([]string{"publish", "--quiet", "--count", fmt.Sprint(count), "--users", "20",
		"--dup-ratio", fmt.Sprint(dupRatio), "--delay-window", "200", "--manifest", path}, extra...)
	out, err := e.idem(args...)
	require.NoError(e.t, err, out)
	m, err := loadgen.ReadManifest(path)
	require.NoError(e.t, err)
	return m
}

// consume starts one `idem consume` with extra environment.
func (e *env) consume(name string, extraEnv ...string) *fleet.Proc {
	e.t.Helper()
	vars := append(append([]string{}, e.vars...), extraEnv...)
	p, err := fleet.Start(fleet.Spec{Bin: binFor("consume", vars), Name: name, Dir: e.dir, Env: vars})
	require.NoError(e.t, err)
	e.procs = append(e.procs, p)
	return p
}

// waitKilled waits for p to die of its armed crash point.
func (e *env) waitKilled(p *fleet.Proc, step string) {
	e.t.Helper()
	select {
	case <-p.Done():
	case <-time.After(60 * time.Second):
		e.t.Fatalf("%s never reached crash point %s", p.Name, step)
	}
	require.True(e.t, p.Killed(), "%s should have died of SIGKILL, exit: %v", p.Name, p.Err())
	b, _ := os.ReadFile(p.LogPath)
	require.Contains(e.t, string(b), crashpoint.Marker+step)
}

// waitConsuming waits until p logged that it consumes, or exited.
func (e *env) waitConsuming(p *fleet.Proc) { e.t.Helper(); testenv.WaitConsuming(e.t, p) }

// waitApplied waits until every manifest event has a ledger row.
func (e *env) waitApplied(m loadgen.Manifest) verify.Report {
	e.t.Helper()
	r, err := verify.Wait(context.Background(), e.pool, m, 90*time.Second)
	require.NoError(e.t, err)
	return r
}

// stopAll waits for the queue to empty (the last re-sends may still be
// queued after every event was applied), then sends SIGTERM to every live
// consumer and requires a clean exit. It returns the summed outcome counts
// of the consumers that exited cleanly.
func (e *env) stopAll() map[string]int64 {
	e.t.Helper()
	require.Eventually(e.t, func() bool { return testenv.QueueDepth(e.t, e.amqpURL, e.queue) <= 0 }, // -1: no such queue (partitions)
		60*time.Second, 20*time.Millisecond, "queue %s never emptied", e.queue)
	totals := map[string]int64{}
	for _, p := range e.procs {
		select {
		case <-p.Done():
			continue // killed earlier, on purpose
		default:
		}
		require.NoError(e.t, p.Stop(30*time.Second), "%s must drain and exit 0 on SIGTERM", p.Name)
		st, err := p.Stats()
		require.NoError(e.t, err)
		for k, v := range st {
			totals[k] += v
		}
	}
	return totals
}

// requireExactlyOnce checks the ledger against every manifest, through
// `idem verify` as an operator would and with direct SQL, and that nothing
// was left in the queue.
func (e *env) requireExactlyOnce(ms ...loadgen.Manifest) {
	e.t.Helper()
	for i, m := range ms {
		r, err := verify.Check(context.Background(), e.pool, m)
		require.NoError(e.t, err)
		require.True(e.t, r.OK(), "manifest %d: %+v", i, r)
		require.Equal(e.t, len(m.Events), r.ExactlyOnce)
		out, err := e.idem("verify", "--manifest", filepath.Join(e.dir, fmt.Sprintf("manifest-%d.json", i)))
		require.NoError(e.t, err, out)
		require.Contains(e.t, out, "PASS")
	}
	var doubled int
	require.NoError(e.t, e.pool.QueryRow(context.Background(),
		`SELECT count(*) FROM (SELECT event_id FROM payments_ledger GROUP BY event_id HAVING count(*) > 1) d`).Scan(&doubled))
	require.Zero(e.t, doubled, "event_ids with more than one ledger row")
	var badBalances int
	require.NoError(e.t, e.pool.QueryRow(context.Background(), `SELECT count(*) FROM account_balances b
		FULL JOIN (SELECT user_id, sum(amount) AS s FROM payments_ledger GROUP BY user_id) l USING (user_id)
		WHERE b.balance IS DISTINCT FROM l.s`).Scan(&badBalances))
	require.Zero(e.t, badBalances, "balances that differ from their ledger sum")
	require.Equal(e.t, 0, testenv.QueueDepth(e.t, e.amqpURL, e.queue), "messages left in %s", e.queue)
}

// untimed marks a Publishing that publishRaw must send without a timestamp.
var untimed = time.Unix(1, 0)

// publishRaw sends bodies as they are, persistent, to the test's queue,
// stamped with the current time unless they carry one (or untimed).
func (e *env) publishRaw(msgs ...amqp.Publishing) {
	e.t.Helper()
	ch := e.channel()
	require.NoError(e.t, broker.TopologyFor(e.queue, e.brokerLimit).Declare(ch))
	require.NoError(e.t, ch.Confirm(false))
	for _, m := range msgs {
		m.DeliveryMode = amqp.Persistent
		switch {
		case m.Timestamp.Equal(untimed):
			m.Timestamp = time.Time{}
		case m.Timestamp.IsZero():
			m.Timestamp = time.Now()
		}
		// A nack (a quorum queue just declared, or busy on a loaded
		// machine) means the broker did not take it: sent again.
		for sends := 1; ; sends++ {
			dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), "", e.queue, true, false, m)
			require.NoError(e.t, err)
			if dc.Wait() {
				break
			}
			require.Less(e.t, sends, 50, "the broker nacked one message 50 times")
			time.Sleep(50 * time.Millisecond)
		}
	}
}

// deadLetters reads n messages from the dead-letter queue (waiting for them)
// and returns them.
func (e *env) deadLetters(n int) []amqp.Delivery {
	e.t.Helper()
	ch := e.channel()
	var out []amqp.Delivery
	deadline := time.Now().Add(60 * time.Second)
	for len(out) < n && time.Now().Before(deadline) {
		d, ok, err := ch.Get(e.queue+".dlq", false)
		require.NoError(e.t, err)
		if !ok {
			time.Sleep(50 * time.Millisecond)
			continue
		}
		out = append(out, d)
		require.NoError(e.t, d.Ack(false))
	}
	require.Len(e.t, out, n, "dead letters")
	return out
}

// waitLog waits until some consumer's log contains text.
func (e *env) waitLog(text string) {
	e.t.Helper()
	require.Eventually(e.t, func() bool {
		for _, p := range e.procs {
			if b, _ := os.ReadFile(p.LogPath); strings.Contains(string(b), text) {
				return true
			}
		}
		return false
	}, 60*time.Second, 20*time.Millisecond, "no consumer logged %q", text)
}

// channel opens an AMQP channel on the test's vhost, closed at the end.
func (e *env) channel() *amqp.Channel {
	e.t.Helper()
	conn, err := amqp.Dial(e.amqpURL)
	require.NoError(e.t, err)
	e.t.Cleanup(func() { conn.Close() })
	ch, err := conn.Channel()
	require.NoError(e.t, err)
	return ch
}

// binFor is the binary that runs command: the harness for its own commands
// and for a consume with a crash point armed, the shipped binary otherwise.
func binFor(command string, env []string) string {
	switch command {
	case "demo", "chaos", "lab", "lab-worker", "bench", "bench-worker":
		return labBin
	}
	for _, v := range env {
		if strings.HasPrefix(v, crashpoint.EnvAt+"=") {
			return labBin
		}
	}
	return idemBin
}
