package harness

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/idemhq/idem/internal/chaos"
	"github.com/idemhq/idem/internal/cli"
)

func runChaos(ctx context.Context, e *cli.Env, args []string) error {
	fs := cli.NewFlags(e, "chaos", `Runs a fleet of 'idem consume' processes on a stream with duplicates
(back-to-back, delayed and concurrent re-sends) while a schedule of faults
drawn from the seed hits it: consumers SIGKILLed and armed to die at every
named crash point; the run's own Redis killed, paused, slowed, flushed and
made to evict; the consumers' Postgres sessions terminated and the run's own
Postgres restarted, and failed over: killed mid-stream, its standby promoted; the consumers' broker connections closed by name; and
the links every consumer reaches Postgres, Redis, the broker and the API
through (fault proxies of the run's own) blackholed, reset and slowed. With
the second hop (the default), every payment also sends a RECEIPT_REQUESTED
through the outbox to a fleet of receipts consumers, which POST each receipt
through theirs to an API the run serves; every consumer runs a relay, crash
points include the relay's, and the API fails and answers slowly for a while.

Then it checks every event was applied exactly once (and every receipt
recorded once, and every receipt's POST acted on once) and nothing is stuck,
prints the verdict, and writes chaos.json (numbers and timeline) and
chaos.html (a timeline chart with the fault windows and breaker state) to
--dir. Exits 1 if anything was doubled, lost or stuck, or a fault could not
be injected. With pg-failover, what a failover undid and the fleet had
acked is lost: with the synchronous standby (the default) that fails the
run; with --async-standby the lost events are named, re-sent once the fleet
settled (with the outbox rows of lost receipts replayed), and the verdict
requires the re-send to apply exactly those, once.

It starts its own redis-server and PostgreSQL cluster (initdb must be
installed; with pg-failover, a primary and a standby made with
pg_basebackup, behind a proxy that moves to the promoted one) and declares its own queue on the broker at AMQP_URL. With
--cluster it starts, instead, a Redis Cluster (redis-cli), a 3-node RabbitMQ
cluster (the rabbitmq-server package, run as the rabbitmq user) and two
PostgreSQL shards, and the Redis faults hit a master (the consumers reach
the Redis Cluster directly, so the redis link kinds are left out). Fault
kinds:
`+chaosKindList())
	path := fs.String("config", "", "YAML config `file` passed to the consumers (connections and queue are the run's own)")
	consumers := fs.Int("consumers", 4, "consumer processes")
	duration := fs.Duration("duration", time.Minute, "how long the stream is published for; faults are spread over it")
	rate := fs.Float64("rate", 300, "messages per second, re-sends included")
	dup := fs.Float64("dup-ratio", 0.25, "re-sends as a fraction of distinct events")
	users := fs.Int("users", 100, "distinct users")
	seed := fs.Uint64("seed", 0, "random seed: the same seed and flags give the same stream and fault schedule (0: from the clock)")
	faults := fs.String("faults", "all", "comma-separated fault kinds to inject, or all")
	settle := fs.Duration("settle", 3*time.Minute, "how long the fleet may take after the stream and the last fault to finish")
	dir := fs.String("dir", "", "directory for logs, chaos.json and chaos.html (default: a new temp dir)")
	cluster := fs.Bool("cluster", false, "run on a Redis Cluster, a 3-node RabbitMQ cluster with partitioned queues and 2 PostgreSQL shards of the run's own, adding rabbit-kill")
	partitions := fs.Int("partitions", 0, "queue partitions of a --cluster run (default 4)")
	async := fs.Bool("async-standby", false, "pg-failover: the standby is asynchronous (streaming replication's default), so that a failover loses acked commits; the run names them and re-sends them")
	twoHop := fs.Bool("two-hop", true, "add the second hop: payments send a RECEIPT_REQUESTED each through the outbox (every consumer runs a relay), receipts consumers record them and POST each to an API the run serves; the verdict checks both hops")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	if *seed == 0 {
		*seed = uint64(time.Now().UnixNano())
	}
	kinds, err := chaos.ParseKinds(*faults, *cluster, *twoHop)
	if err != nil {
		fmt.Fprintf(e.Stderr, "idem-lab chaos: --faults: %v\n", err)
		return cli.ErrUsage
	}
	cfg, _, err := e.LoadConfig(*path)
	if err != nil {
		return err
	}
	if *path != "" {
		if *path, err = filepath.Abs(*path); err != nil {
			return err
		}
	}
	if *dir == "" {
		*dir, err = os.MkdirTemp("", "idem-chaos-")
		if err != nil {
			return err
		}
	}
	bin, err := os.Executable()
	if err != nil {
		return err
	}
	res, err := chaos.Run(ctx, chaos.Options{
		Bin: bin, Dir: *dir, AMQPURL: cfg.AMQPURL, Consumers: *consumers, Duration: *duration, Rate: *rate,
		DupRatio: *dup, Users: *users, Seed: *seed, Faults: kinds, Settle: *settle, ConfigPath: *path,
		Cluster: *cluster, Partitions: *partitions, TwoHop: *twoHop, AsyncStandby: *async, Progress: e.Stderr,
	})
	if err != nil {
		return err
	}
	fmt.Fprintln(e.Stdout)
	res.Print(e.Stdout)
	jsonPath, htmlPath := filepath.Join(*dir, "chaos.json"), filepath.Join(*dir, "chaos.html")
	if err := res.WriteJSON(jsonPath); err != nil {
		return err
	}
	if err := res.WriteHTML(htmlPath); err != nil {
		return err
	}
	fmt.Fprintf(e.Stdout, "\nreport: %s\nnumbers: %s\nconsumer logs: %s\n", htmlPath, jsonPath, *dir)
	if !res.OK {
		return cli.ErrVerifyFailed
	}
	return nil
}

func chaosKindList() string {
	var s string
	for _, k := range chaos.Kinds {
		s += fmt.Sprintf("  %-15s %s\n", k, chaos.Describe[k])
	}
	return s[:len(s)-1]
}
