package harness

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/idemhq/idem/internal/cli"
	"github.com/idemhq/idem/internal/lab"
)

func runLab(ctx context.Context, e *cli.Env, args []string) error {
	fs := cli.NewFlags(e, "lab", `Runs the approaches to deduplicating an at-least-once stream side by side
on the same stream and the same faults, and prints what each did:

`+labApproachList()+`

Each approach runs three passes, each on a fresh schema, queue and Redis:
  clean  no faults: what the races between workers do, and the cost
  crash  one worker SIGKILLed after its check, one after its effect, and the
         workers' Postgres sessions terminated halfway
  redis  Redis killed at 30% (down for --outage, back empty) and flushed at 70%

Columns: events applied more than once ("doubled"), events never applied
("lost"), messages acked per second while Redis was down, Postgres and Redis
round trips per message published and throughput in the clean pass (the
median over --runs).

It uses the Postgres at DATABASE_URL (a schema per pass, dropped after), the
broker at AMQP_URL (a queue per pass, deleted after) and a redis-server of
its own; it needs rabbitmqctl to see unacked messages.`)
	approaches := fs.String("approaches", strings.Join(lab.Approaches, ","), "comma-separated approaches to run")
	events := fs.Int("events", 4000, "distinct events per pass")
	dup := fs.Float64("dup-ratio", 0.25, "re-sends as a fraction of events, half back-to-back, half delayed")
	users := fs.Int("users", 100, "distinct users")
	seed := fs.Uint64("seed", 1, "random seed: stream and crash points")
	procs := fs.Int("processes", 2, "worker processes per pass")
	workers := fs.Int("workers", 8, "concurrent handlers per process")
	prefetch := fs.Int("prefetch", 32, "unacked messages per process")
	ttl := fs.Duration("ttl", 24*time.Hour, "TTL of the Redis keys of the Redis approaches")
	outage := fs.Duration("outage", 3*time.Second, "how long Redis stays down in the redis pass")
	drain := fs.Duration("drain", 2*time.Minute, "how long a pass may take to empty its queue")
	pgLatency := fs.Duration("pg-latency", 0, "delay added each way between the workers and Postgres, through a proxy (e.g. 1ms: a primary in another zone)")
	runs := fs.Int("runs", 1, "repeat the clean pass this many times; the table shows medians")
	dir := fs.String("dir", "", "directory for worker logs (default: a new temp dir)")
	jsonOut := fs.String("json", "", "also write the results as JSON to this `file`")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	cfg, _, err := e.LoadConfig("")
	if err != nil {
		return err
	}
	if *dir == "" {
		if *dir, err = os.MkdirTemp("", "idem-lab-"); err != nil {
			return err
		}
	}
	bin, err := os.Executable()
	if err != nil {
		return err
	}
	var names []string
	for _, a := range strings.Split(*approaches, ",") {
		names = append(names, strings.TrimSpace(a))
	}
	rows, err := lab.Run(ctx, lab.Options{
		Bin: bin, Dir: *dir, AMQPURL: cfg.AMQPURL, DatabaseURL: cfg.DatabaseURL, Approaches: names,
		Events: *events, DupRatio: *dup, Users: *users, Seed: *seed, Processes: *procs, Workers: *workers,
		Prefetch: *prefetch, TTL: *ttl, Runs: *runs, PGLatency: *pgLatency, Outage: *outage, Drain: *drain, Progress: e.Stderr,
	})
	if err != nil {
		return err
	}
	fmt.Fprintln(e.Stdout)
	if *pgLatency > 0 {
		fmt.Fprintf(e.Stdout, "workers reach Postgres with %s added each way\n\n", *pgLatency)
	}
	lab.Print(e.Stdout, rows)
	if *jsonOut != "" {
		b, _ := json.MarshalIndent(rows, "", "  ")
		if err := os.WriteFile(*jsonOut, b, 0o644); err != nil {
			return err
		}
	}
	return nil
}

func labApproachList() string {
	var b strings.Builder
	for _, a := range lab.Approaches {
		fmt.Fprintf(&b, "  %-18s %s\n", a, lab.Titles[a])
	}
	return strings.TrimRight(b.String(), "\n")
}

func runLabWorker(ctx context.Context, e *cli.Env, args []string) error {
	fs := cli.NewFlags(e, "lab-worker", "One worker process of 'idem-lab lab' (started by it): consumes --queue with one\napproach. DATABASE_URL, REDIS_URL and AMQP_URL say where; IDEM_CRASH_AT\n("+lab.AfterCheck+" or "+lab.AfterEffect+") and IDEM_CRASH_AFTER arm a SIGKILL.")
	o := lab.WorkerOptions{}
	fs.StringVar(&o.Approach, "approach", "", "the approach: "+strings.Join(lab.Approaches, ", "))
	fs.StringVar(&o.Queue, "queue", "", "queue to consume")
	fs.StringVar(&o.Name, "name", "idem-lab-worker", "connection `name`")
	fs.StringVar(&o.StatsFile, "stats-file", "", "write counts as JSON to this `file`")
	fs.IntVar(&o.Workers, "workers", 8, "concurrent handlers")
	fs.IntVar(&o.Prefetch, "prefetch", 32, "unacked messages")
	fs.DurationVar(&o.TTL, "ttl", 24*time.Hour, "Redis key TTL")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	if o.Queue == "" || o.StatsFile == "" {
		fmt.Fprintln(e.Stderr, "idem-lab lab-worker: --queue and --stats-file are required")
		return cli.ErrUsage
	}
	cfg, log, err := e.LoadConfig("")
	if err != nil {
		return err
	}
	o.AMQPURL, o.DatabaseURL, o.RedisURL, o.Logger, o.Getenv = cfg.AMQPURL, cfg.DatabaseURL, cfg.RedisURL, log, e.Getenv
	o.StatsFile, _ = filepath.Abs(o.StatsFile)
	return lab.RunWorker(ctx, o)
}
