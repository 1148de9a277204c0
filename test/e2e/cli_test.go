package e2e

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/cli"
	"github.com/idemhq/idem/internal/crashpoint"
	"github.com/idemhq/idem/internal/testenv"
)

// TestVerifyCatchesDoublesAndLosses makes sure the check every other test
// leans on can fail: a doubled ledger row and a lost one must each turn
// `idem verify` red.
func TestVerifyCatchesDoublesAndLosses(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	m := e.publish(50, 0.2)
	e.consume("c0")
	e.waitApplied(m)
	e.stopAll()
	manifest := filepath.Join(e.dir, "manifest-0.json")
	out, err := e.idem("verify", "--manifest", manifest)
	require.NoError(t, err, out)

	ctx := context.Background()
	_, err = e.pool.Exec(ctx, `INSERT INTO payments_ledger (event_id, user_id, amount)
		SELECT event_id, user_id, amount FROM payments_ledger ORDER BY id LIMIT 1`)
	require.NoError(t, err)
	out, err = e.idem("verify", "--manifest", manifest)
	require.Equal(t, 1, testenv.ExitCode(err), out)
	require.Regexp(t, `doubled\s+1`, out)
	require.Contains(t, out, "FAIL")

	// Remove the double (the newest row), then one genuine row.
	for range 2 {
		_, err = e.pool.Exec(ctx, `DELETE FROM payments_ledger WHERE id = (SELECT max(id) FROM payments_ledger)`)
		require.NoError(t, err)
	}
	out, err = e.idem("verify", "--manifest", manifest)
	require.Equal(t, 1, testenv.ExitCode(err), out)
	require.Regexp(t, `missing\s+1`, out)

	_, err = e.pool.Exec(ctx, `UPDATE account_balances SET balance = balance + 1
		WHERE user_id = (SELECT min(user_id) FROM account_balances)`)
	require.NoError(t, err)
	out, err = e.idem("verify", "--manifest", manifest)
	require.Equal(t, 1, testenv.ExitCode(err), out)
	require.Regexp(t, `balance mismatches\s+1`, out)
}

func TestCommandLineContract(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	e.publishRaw() // declares the queue with the default x-delivery-limit
	cases := []struct {
		args     []string
		env      []string
		code     int
		contains string
	}{
		{[]string{"--help"}, nil, 0, "Commands:"},
		{nil, nil, 2, "Usage: idem <command>"},
		{[]string{"frobnicate"}, nil, 2, `unknown command "frobnicate"`},
		{[]string{"consume", "-h"}, nil, 0, "Usage: idem consume"},
		{[]string{"publish", "--count", "x"}, nil, 2, "invalid value"},
		{[]string{"verify"}, nil, 2, "--manifest is required"},
		{[]string{"verify", "--manifest", "/nonexistent"}, nil, 1, "no such file"},
		{[]string{"consume"}, []string{"IDEM_REDIS_DONE_TTL=2000h"}, 1, "redis.done_ttl"},
		{[]string{"consume"}, []string{"IDEM_CONSUMER_WORKERS=lots"}, 1, "consumer.workers"},
		{[]string{"consume"}, []string{"IDEM_CRASH_AT=nowhere"}, 1, "not a crash point"},
		{[]string{"consume", "--config", "/nonexistent.yaml"}, nil, 1, "no such file"},
		{[]string{"migrate"}, nil, 0, "up to date"},
		{[]string{"consume"}, []string{"IDEM_CONSUMER_BROKER_DELIVERY_LIMIT=7"}, 1, "PRECONDITION_FAILED"},
		{[]string{"config"}, nil, 0, "IDEM_REDIS_DONE_TTL"},
		{[]string{"version"}, nil, 0, "idem " + cli.Release + " (github.com/idemhq/idem "},
		{[]string{"--version"}, nil, 0, runtime.Version()},
		{[]string{"bench", "--events", "10"}, nil, 1, "--events must be at least 100"},
		{[]string{"bench", "--rows", "fastest"}, nil, 1, "--rows matched no row"},
	}
	for _, c := range cases {
		saved := e.vars
		e.vars = append(append([]string{}, e.vars...), c.env...)
		out, err := e.idem(c.args...)
		e.vars = saved
		require.Equal(t, c.code, testenv.ExitCode(err), "idem %v: %s", c.args, out)
		require.Contains(t, out, c.contains, "idem %v", c.args)
	}
}

// TestBenchMeasuresAndVerifies runs `idem-lab bench` on a few small rows: it
// prints the table with each row's ratio to its baseline, and every idem run
// in it was verified exactly-once.
func TestBenchMeasuresAndVerifies(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	path := filepath.Join(e.dir, "bench.json")
	out, err := e.idem("bench", "--runs", "1", "--events", "400", "--json", path,
		"--rows", "raw 25%;batched, Redis on, 25%;per-event, Redis off, 25%;batched, Redis on, 100%")
	require.NoError(t, err, out)
	require.Regexp(t, `\| batched, Redis on, 25% \| \d+ \| \d\.\d\d× raw 25% \|`, out)
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	var results []struct {
		Row struct {
			Name string `json:"name"`
		} `json:"row"`
		Rate     float64          `json:"rate"`
		Doubled  int              `json:"doubled"`
		Missing  int              `json:"missing"`
		Outcomes map[string]int64 `json:"outcomes"`
	}
	require.NoError(t, json.Unmarshal(b, &results))
	require.Len(t, results, 4)
	for _, r := range results {
		require.Positive(t, r.Rate, r.Row.Name)
		require.Zero(t, r.Doubled+r.Missing, r.Row.Name)
	}
	dups := results[3].Outcomes
	require.Zero(t, dups["processed"], "a processed stream comes back as duplicates")
	require.Equal(t, int64(400), dups["duplicate_redis"]+dups["duplicate_postgres"], "%v", dups)
	require.Positive(t, dups["duplicate_redis"], "%v", dups)
}

// TestTheRepositoryStandsOnItsOwn: a licence, a changelog, a version that
// names the revision it was built from, and docs that point at nothing
// outside the repository.
func TestTheRepositoryStandsOnItsOwn(t *testing.T) {
	t.Parallel()
	lic, err := os.ReadFile("../../LICENSE")
	require.NoError(t, err)
	require.Contains(t, string(lic), "Apache License\n                           Version 2.0")
	changelog, err := os.ReadFile("../../CHANGELOG.md")
	require.NoError(t, err)
	require.Contains(t, string(changelog), "## Unreleased")

	out, err := exec.Command(idemBin, "version").CombinedOutput()
	require.NoError(t, err, string(out))
	release := regexp.MustCompile(`(?m)^## (\d+\.\d+\.\d+)`).FindStringSubmatch(string(changelog))
	require.NotNil(t, release, "CHANGELOG.md names no release")
	require.Contains(t, string(out), "idem "+release[1]+" ", "the version is the changelog's latest release")
	if _, err := os.Stat("../../.git"); err == nil {
		require.Regexp(t, regexp.MustCompile(`\b[0-9a-f]{40}\b`), string(out), "a build from a checkout names its revision")
	}

	docs, err := filepath.Glob("../../docs/*.md")
	require.NoError(t, err)
	for _, f := range append(docs, "../../README.md", "../../CHANGELOG.md") {
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		require.NotRegexp(t, `shared/|DESIGN\.md|STYLE\.md|\bI[1-8]\b`, string(b), "%s points outside the repository", f)
	}
}

// TestTheShippedBinaryHoldsNoHarness: the idem binary links none of the
// harness (crash points, the process runner, the servers it starts, chaos,
// the lab, the bench), so nothing in it can kill itself or start a
// database; idem-lab holds them, and its consume can be armed.
func TestTheShippedBinaryHoldsNoHarness(t *testing.T) {
	t.Parallel()
	harness := []string{"internal/crashpoint", "internal/fleet", "internal/sandbox", "internal/chaos", "internal/lab", "internal/bench", "internal/harness", "internal/testenv"}
	linked := func(bin string) string {
		out, err := exec.Command("go", "tool", "nm", bin).CombinedOutput()
		require.NoError(t, err, "%s", out)
		return string(out)
	}
	prod := linked(idemBin)
	for _, pkg := range harness {
		require.NotContains(t, prod, "github.com/idemhq/idem/"+pkg+".", "the shipped binary links %s", pkg)
	}
	require.Contains(t, linked(labBin), "github.com/idemhq/idem/internal/crashpoint.")

	e := newEnv(t, "", "")
	r := e.run(nil, "chaos", "--help")
	require.Zero(t, r.code, r.out)
	out, err := exec.Command(idemBin, "chaos").CombinedOutput()
	require.Error(t, err)
	require.Contains(t, string(out), `idem: unknown command "chaos"`)
	// An armed crash point means nothing to the shipped consume.
	cmd := exec.Command(idemBin, "consume")
	cmd.Env = append(append(os.Environ(), e.vars...), crashpoint.EnvAt+"=not_a_step", "IDEM_CONSUMER_STARTUP_TIMEOUT=1s", "AMQP_URL=amqp://guest:guest@127.0.0.1:1/")
	out, _ = cmd.CombinedOutput()
	require.Contains(t, string(out), "RabbitMQ was not reachable")
	require.NotContains(t, string(out), "crash point")
}
