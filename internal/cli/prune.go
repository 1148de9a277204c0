package cli

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"github.com/idemhq/idem/internal/horizon"
)

func runPrune(ctx context.Context, e *Env, args []string) error {
	fs := NewFlags(e, "prune", `Deletes dedup rows processed longer ago than postgres.retention plus the
consumers' clock skew. Consumers record in the database the retention they
enforce; prune refuses a shorter one, so pruning never lets a replay through
twice. It records how far it cut before deleting, and consumers refuse events
older than that.`)
	path := fs.String("config", "", "YAML config `file`")
	batch := fs.Int("batch", 10000, "rows deleted per statement")
	reset := fs.Bool("reset-horizon", false, "first set the recorded retention to this config's (after lowering every consumer's retention); the clock skew is only ever raised")
	cutUntimed := fs.Bool("cut-untimed", false, "make the first cut although events without a time were claimed within the retention; from then on such events are refused (missing_time)")
	if err := Parse(fs, args); err != nil {
		return err
	}
	if *batch < 1 {
		return UsageErr(e, "idem prune: --batch must be at least 1, got %d", *batch)
	}
	cfg, _, dbs, err := e.LoadDB(ctx, *path)
	if err != nil {
		return err
	}
	defer dbs.Close()
	// Each shard keeps its own horizon: its consumers record it there.
	for i, pool := range dbs {
		where := cmp.Or(dbs.name(i), "database")
		if *reset {
			if err := horizon.Reset(ctx, pool, cfg.Postgres.Retention, cfg.Consumer.ClockSkew); err != nil {
				return fmt.Errorf("%s: %w", where, unmigrated(err))
			}
		}
		n, cutoff, err := horizon.Prune(ctx, pool, horizon.PruneConfig{
			Retention: cfg.Postgres.Retention, ClockSkew: cfg.Consumer.ClockSkew, Batch: *batch, CutUntimed: *cutUntimed})
		if err != nil {
			return fmt.Errorf("%s: %w", where, unmigrated(err))
		}
		prefix := ""
		if len(dbs) > 1 {
			prefix = where + ": "
		}
		fmt.Fprintf(e.Stdout, "%spruned %d dedup rows processed before %s\n", prefix, n, cutoff.UTC().Format(time.RFC3339))
	}
	return nil
}
