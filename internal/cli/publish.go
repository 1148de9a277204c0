package cli

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/idemhq/idem/internal/loadgen"
)

func runPublish(ctx context.Context, e *Env, args []string) error {
	fs := NewFlags(e, "publish", "Publishes a reproducible stream of PAYMENT_COMPLETED events with duplicates\nto the queue, persistent, with publisher confirms, and can write a manifest\nof what it sent for 'idem verify'. Checks the stream's partition count in the\ndatabase first, applying idem's pending migrations unless --no-migrate.")
	path := fs.String("config", "", "YAML config `file`")
	e.targetFlags(fs, false, true)
	count := fs.Int("count", 10000, "distinct events")
	users := fs.Int("users", 100, "distinct users")
	dup := fs.Float64("dup-ratio", 0.25, "re-sends as a fraction of count, half back-to-back, half delayed")
	window := fs.Int("delay-window", 1000, "a delayed re-send comes up to this many messages later")
	rate := fs.Float64("rate", 0, "messages per second (0: as fast as confirms allow)")
	seed := fs.Uint64("seed", uint64(time.Now().UnixNano()), "random seed (the same seed and flags give the same stream)")
	run := fs.String("run", "", "run id in event and user ids (default: derived from the seed)")
	manifest := fs.String("manifest", "", "write the manifest to this `file`")
	quiet := fs.Bool("quiet", false, "no progress lines")
	partitions := fs.Int("partitions", 0, "split the stream over `N` queues <queue>.0 … by userId (default: the partitions setting)")
	noMigrate := fs.Bool("no-migrate", false, "do not apply idem's pending migrations at start; refuse to start if one is missing")
	if err := Parse(fs, args); err != nil {
		return err
	}
	cfg, log, err := e.LoadConfig(*path)
	if err != nil {
		return err
	}
	if *partitions > 0 {
		cfg.Partitions = *partitions
	}
	if err := checkPartitions(ctx, cfg, log, !*noMigrate); err != nil {
		return err
	}
	if *run == "" {
		*run = loadgen.RunID(*seed)
	}
	spec := loadgen.StreamSpec{RunID: *run, Count: *count, Users: *users, DupRatio: *dup, DelayWindow: *window, Seed: *seed}
	s, err := loadgen.Build(spec)
	if err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	opt := loadgen.PublishOptions{
		URL:            cfg.AMQPURL,
		Topology:       cfg.Topology(),
		ConnectionName: fmt.Sprintf("idem-publish-%d", os.Getpid()),
		Rate:           *rate,
	}
	if !*quiet {
		opt.Progress = e.Stderr
		fmt.Fprintf(e.Stderr, "run %s: %d messages, %d distinct events, %d back-to-back and %d delayed re-sends, to queue %s\n",
			*run, len(s.Order), len(s.Events), s.BackToBack, s.Delayed, strings.Join(cfg.Topology().Queues(), ", "))
	}
	if err := loadgen.Publish(ctx, opt, s); err != nil {
		return err
	}
	if *manifest != "" {
		if err := loadgen.NewManifest(spec, cfg.Queue, s).Write(*manifest); err != nil {
			return fmt.Errorf("publish: write manifest: %w", err)
		}
		if !*quiet {
			fmt.Fprintf(e.Stderr, "manifest written to %s\n", *manifest)
		}
	}
	return nil
}
