package harness

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/idemhq/idem/internal/bench"
	"github.com/idemhq/idem/internal/cli"
	"github.com/idemhq/idem/internal/sandbox"
)

func runBench(ctx context.Context, e *cli.Env, args []string) error {
	var names []string
	for _, r := range bench.Rows(defaultPGLatency) {
		names = append(names, "  "+r.Name)
	}
	fs := cli.NewFlags(e, "bench", `Measures idem against a raw consumer that only consumes and acks, every row
on the same broker, database and Redis in one run, and prints a table:
messages per second (median of --runs) and the ratio to the row's baseline,
CPU per message of the consumer, PostgreSQL, RabbitMQ and Redis (from /proc),
Postgres and Redis round trips per message, the consumer's peak RSS, errors,
breaker transitions, and events doubled or missing (each idem run is
verified; any doubled or missing event makes the command exit 1). Rates
and CPU are measured from the moment a worker's consumer is on the queue,
so its start-up (connections, start-up checks) is not spread over the
messages; the baseline table gives the start-up in its own column. Each row gets a fresh queue, schema and Redis key prefix; a
"100%" row's stream was processed once before, by a set of the row's own
workers, so every message is a duplicate. The rows:

`+strings.Join(names, "\n")+`

The "Postgres N ms away" rows (--pg-latency; 0 leaves them out) reach
PostgreSQL through a proxy in this process that delays every reply by N ms,
so each round trip takes N ms more; their ratio is to the same row beside
Postgres. A second table splits the Postgres round trips of each idem row
by cause (begin, claim, history, wal-message, lookup, commit, rollback,
apply, session, other), with the time waited on them, per message. A third
table, for the pairs of rows that differ only in Redis on or off, gives the
median of the per-run ratios of their throughputs.

With --baseline-bin, an idem-lab built from an earlier commit (make bench
builds one of BASELINE, by default HEAD, with .ci/build-baseline.sh), every
idem row also runs with the baseline's bench-workers, beside the same row
with this build's, on the same stream, in every run (the baseline's first
in every second run); a table sets the
two builds side by side (throughput, the median of the per-run ratios, CPU
and Postgres round trips per message, start-up), and the Redis table gets the
baseline's column. The schemas are made by this build's migrations for
both builds.

The 10M-row row pre-fills a dedup table once, in a schema kept for later
runs (about a minute). Run it on an otherwise idle machine: CPU is read for
every postgres, beam.smp and redis-server process.`)
	events := fs.Int("events", 20000, "messages per row")
	runs := fs.Int("runs", 3, "runs of each row; the table shows medians")
	users := fs.Int("users", 10000, "distinct users the payments spread over")
	prefill := fs.Int("prefill", 10_000_000, "rows in the pre-filled dedup table")
	rate := fs.Float64("rate", 5000, "offered rate of the latency row, messages/s")
	latencyFor := fs.Duration("latency-for", 10*time.Second, "how long the latency row publishes")
	rows := fs.String("rows", "", "semicolon-separated row names to run (default: all)")
	pgLatency := fs.Duration("pg-latency", defaultPGLatency, "round trip added between the workers and PostgreSQL in the remote rows, whole milliseconds; 0 leaves them out")
	baselineBin := fs.String("baseline-bin", "", "also run every idem row with the bench-workers of this idem-lab `binary`, built from an earlier commit (.ci/build-baseline.sh REV OUT)")
	seed := fs.Uint64("seed", 1, "random seed of the streams")
	jsonPath := fs.String("json", "", "also write the results as JSON to this `file`")
	svgPath := fs.String("svg", "", "also write a bar chart of the ratios as SVG to this `file`")
	dir := fs.String("dir", "", "worker logs go here (default: a temporary directory)")
	profile := fs.Bool("profile", false, "write a CPU profile of each worker into --dir")
	render := fs.String("render", "", "run nothing: print the tables (and write --svg) from the JSON `file` of an earlier run")
	standby := fs.String("standby", "", "run on a PostgreSQL of the run's own instead of the configured one: `none` (alone), async (with a streaming standby) or sync (with a synchronous standby), to measure what a standby costs")
	standbyLatency := fs.Duration("standby-latency", 0, "with --standby async or sync, delay the standby's replication connection by this much each way (a standby in another zone)")
	outboxRows := fs.Bool("outbox", false, "run the outbox rows instead: a raw confirming publisher (amqp091 alone, as many in flight as a relay pass) and relay throughput with confirms against it (one and two relays, --events rows prefilled; with --baseline-bin, each relay row again with the baseline's relays), each run going through every row, commit-to-delivery latency and the two-hop pipeline's latency at --rate (default 2000 with --outbox) for --latency-for")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	if *render != "" {
		b, err := os.ReadFile(*render)
		if err != nil {
			return err
		}
		var results []bench.Result
		if err := json.Unmarshal(b, &results); err != nil {
			return fmt.Errorf("bench: %s: %w", *render, err)
		}
		bench.Print(e.Stdout, results)
		return writeChart(*svgPath, results)
	}
	cfg, _, err := e.LoadConfig("")
	if err != nil {
		return err
	}
	if *standby != "" {
		dbURL, remove, err := benchPostgres(*standby, *standbyLatency)
		if err != nil {
			return err
		}
		defer remove()
		cfg.DatabaseURL = dbURL
		fmt.Fprintf(e.Stdout, "idem-lab bench: on a PostgreSQL of the run's own (fsync off), standby: %s, replication latency %s each way\n", *standby, *standbyLatency)
	}
	bin, err := os.Executable()
	if err != nil {
		return err
	}
	if *dir == "" {
		if *dir, err = os.MkdirTemp("", "idem-bench-"); err != nil {
			return err
		}
	} else if err := os.MkdirAll(*dir, 0o755); err != nil {
		return err
	}
	if *outboxRows {
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		if !set["rate"] {
			*rate = 2000
		}
		return runOutboxBench(ctx, e, bench.OutboxOptions{
			Bin: bin, BaselineBin: *baselineBin, Dir: *dir, AMQPURL: cfg.AMQPURL, DatabaseURL: cfg.DatabaseURL, RedisURL: cfg.RedisURL,
			Messages: *events, Rate: *rate, LatencyFor: *latencyFor, Runs: *runs, Progress: e.Stderr,
		}, *jsonPath)
	}
	var only []string
	for _, r := range strings.Split(*rows, ";") {
		if r = strings.TrimSpace(r); r != "" {
			only = append(only, r)
		}
	}
	fmt.Fprintf(e.Stdout, "idem-lab bench: %d messages per row, %d run(s) each; worker logs in %s\n", *events, *runs, *dir)
	if *baselineBin != "" {
		fmt.Fprintf(e.Stdout, "idem-lab bench: every idem row also runs with the workers of %s\n", *baselineBin)
	}
	results, err := bench.Run(ctx, bench.Options{
		Bin: bin, Dir: *dir, AMQPURL: cfg.AMQPURL, DatabaseURL: cfg.DatabaseURL, RedisURL: cfg.RedisURL,
		Events: *events, Users: *users, Runs: *runs, Prefill: *prefill, Rate: *rate, LatencyFor: *latencyFor,
		Only: only, Seed: *seed, Profile: *profile, Progress: e.Stderr,
		PGLatency: *pgLatency, BaselineBin: *baselineBin,
	})
	if len(results) > 0 {
		fmt.Fprintln(e.Stdout)
		bench.Print(e.Stdout, results)
	}
	if err != nil {
		return err
	}
	if *jsonPath != "" {
		b, err := json.MarshalIndent(results, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(*jsonPath, append(b, '\n'), 0o644); err != nil {
			return err
		}
	}
	if err := writeChart(*svgPath, results); err != nil {
		return err
	}
	for _, r := range results {
		if r.Doubled > 0 || r.Missing > 0 {
			return fmt.Errorf("bench: %s: %d events doubled and %d missing: the runs were not exactly-once", r.Label(), r.Doubled, r.Missing)
		}
	}
	return nil
}

// defaultPGLatency is --pg-latency's default: a database in the same zone.
const defaultPGLatency = time.Millisecond

// benchPostgres starts the PostgreSQL that --standby names, and returns
// the primary's own URL (no proxy in between) and what removes it.
func benchPostgres(standby string, latency time.Duration) (string, func(), error) {
	switch standby {
	case "none":
		pg, err := sandbox.StartPostgres("")
		if err != nil {
			return "", nil, err
		}
		return pg.URL(), pg.Remove, nil
	case "async", "sync":
		p, err := sandbox.StartPair("", sandbox.PairConfig{Synchronous: standby == "sync", ReplicationLatency: latency})
		if err != nil {
			return "", nil, err
		}
		return p.Primary.URL(), p.Remove, nil
	}
	return "", nil, fmt.Errorf("bench: --standby %q: want none, async or sync", standby)
}

// writeChart writes the bar chart of results to path, if path is set.
func writeChart(path string, results []bench.Result) error {
	if path == "" {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	bench.Chart(f, results)
	return f.Close()
}

// runOutboxBench runs and prints the outbox rows.
func runOutboxBench(ctx context.Context, e *cli.Env, o bench.OutboxOptions, jsonPath string) error {
	fmt.Fprintf(e.Stdout, "idem-lab bench --outbox: %d prefilled rows per throughput run, %.0f msg/s for %s per latency run, %d run(s) each; logs in %s\n",
		o.Messages, o.Rate, o.LatencyFor, o.Runs, o.Dir)
	results, err := bench.RunOutbox(ctx, o)
	if len(results) > 0 {
		fmt.Fprintln(e.Stdout)
		bench.PrintOutbox(e.Stdout, results)
	}
	if err != nil {
		return err
	}
	if jsonPath != "" {
		b, err := json.MarshalIndent(results, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(jsonPath, append(b, '\n'), 0o644); err != nil {
			return err
		}
	}
	for _, r := range results {
		if r.Lost > 0 || r.Doubled > 0 {
			return fmt.Errorf("bench: %s: %d lost and %d doubled", r.Row, r.Lost, r.Doubled)
		}
	}
	return nil
}
