package harness

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/idemhq/idem/internal/cli"
	"github.com/idemhq/idem/internal/fleet"
	"github.com/idemhq/idem/internal/loadgen"
	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/verify"
)

func runDemo(ctx context.Context, e *cli.Env, args []string) error {
	fs := cli.NewFlags(e, "demo", "The main job, end to end: migrates, starts a fleet of 'idem consume'\nprocesses, publishes a stream with duplicates, waits until every event is\napplied, stops the fleet with SIGTERM and prints the verification table and\nthe fleet's outcome counts. Exits 1 if anything was doubled or lost.")
	path := fs.String("config", "", "YAML config `file` (passed to the consumers too)")
	consumers := fs.Int("consumers", 3, "consumer processes")
	count := fs.Int("count", 20000, "distinct events")
	users := fs.Int("users", 100, "distinct users")
	dup := fs.Float64("dup-ratio", 0.25, "re-sends as a fraction of count")
	seed := fs.Uint64("seed", uint64(time.Now().UnixNano()), "random seed")
	timeout := fs.Duration("timeout", 5*time.Minute, "give up if the fleet has not applied every event by then")
	dir := fs.String("dir", "", "directory for consumer logs and the manifest (default: a new temp dir)")
	if err := cli.Parse(fs, args); err != nil {
		return err
	}
	if *consumers < 1 {
		return cli.UsageErr(e, "idem-lab demo: --consumers must be at least 1, got %d", *consumers)
	}
	cfg, log, dbs, err := e.LoadDB(ctx, *path)
	if err != nil {
		return err
	}
	if *dir == "" {
		*dir, err = os.MkdirTemp("", "idem-demo-")
	} else {
		err = os.MkdirAll(*dir, 0o755)
	}
	if err != nil {
		return fmt.Errorf("demo: --dir: %w", err)
	}
	bin, err := os.Executable()
	if err != nil {
		return err
	}
	defer dbs.Close()
	for _, pool := range dbs {
		if _, err := payments.Migrate(ctx, pool); err != nil {
			return err
		}
	}

	run := loadgen.RunID(*seed)
	fmt.Fprintf(e.Stdout, "run %s: %d consumers, %d events + %.0f%% duplicates, logs in %s\n", run, *consumers, *count, *dup*100, *dir)
	var procs []*fleet.Proc
	defer func() {
		for _, p := range procs {
			p.Kill() // only reached on error paths; a no-op after Stop
		}
	}()
	var extra []string
	if *path != "" {
		extra = []string{"--config", *path}
	}
	for i := range *consumers {
		p, err := fleet.Start(fleet.Spec{Bin: bin, Name: fmt.Sprintf("demo-%s-%d", run, i), Dir: *dir, Args: extra})
		if err != nil {
			return err
		}
		procs = append(procs, p)
	}

	spec := loadgen.StreamSpec{RunID: run, Count: *count, Users: *users, DupRatio: *dup, DelayWindow: 1000, Seed: *seed}
	s, err := loadgen.Build(spec)
	if err != nil {
		return err
	}
	m := loadgen.NewManifest(spec, cfg.Queue, s)
	manifestPath := *dir + "/manifest.json"
	if err := m.Write(manifestPath); err != nil {
		return err
	}
	start := time.Now()
	if err := loadgen.Publish(ctx, loadgen.PublishOptions{
		URL:            cfg.AMQPURL,
		Topology:       cfg.Topology(),
		ConnectionName: "idem-demo-publish",
		Progress:       e.Stderr,
	}, s); err != nil {
		return err
	}
	r, err := verify.WaitShards(ctx, dbs, m, *timeout)
	if err != nil {
		return err
	}
	elapsed := time.Since(start)
	totals := map[string]int64{}
	for _, p := range procs {
		if err := p.Stop(cfg.Consumer.DrainTimeout + 5*time.Second); err != nil {
			log.Warn("consumer did not stop cleanly", "consumer", p.Name, "err", err)
		}
		st, err := p.Stats()
		if err != nil {
			log.Warn("no stats from consumer", "consumer", p.Name, "err", err)
			continue
		}
		for k, v := range st {
			totals[k] += v
		}
	}
	procs = nil

	fmt.Fprintf(e.Stdout, "\nfleet outcomes (%d consumers, %.1fs from first publish to last effect, %.0f msg/s)\n",
		*consumers, elapsed.Seconds(), float64(m.Messages)/elapsed.Seconds())
	printCounts(e, totals)
	fmt.Fprintln(e.Stdout)
	r.Print(e.Stdout)
	fmt.Fprintf(e.Stdout, "\nmanifest: %s (re-check with: idem verify --manifest %s)\n", manifestPath, manifestPath)
	if !r.OK() {
		return cli.ErrVerifyFailed
	}
	return nil
}

// printCounts prints the outcome counts, and the counters and per-reason
// counts ("count/…", "dead_lettered/…") that are not zero.
func printCounts(e *cli.Env, counts map[string]int64) {
	keys := make([]string, 0, len(counts))
	for k, v := range counts {
		if v != 0 || !strings.Contains(k, "/") {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	tw := tabwriter.NewWriter(e.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	for _, k := range keys {
		fmt.Fprintf(tw, "%s\t%d\t\n", k, counts[k])
	}
	_ = tw.Flush()
}
