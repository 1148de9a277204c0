package cli

import (
	"context"
	"fmt"
	"time"

	"github.com/idemhq/idem/pkg/guard/pgtier"
)

func runPrune(ctx context.Context, e *env, args []string) error {
	fs := newFlags(e, "prune", `Deletes dedup rows processed longer ago than postgres.retention plus the
consumers' clock skew. Consumers record in the database the retention they
enforce; prune refuses a shorter one, so pruning never lets a replay through
twice. It records how far it cut before deleting, and consumers refuse events
older than that.`)
	path := fs.String("config", "", "YAML config `file`")
	batch := fs.Int("batch", 10000, "rows deleted per statement")
	reset := fs.Bool("reset-horizon", false, "first set the recorded retention and clock skew to this config's (after lowering every consumer's retention)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *batch < 1 {
		return fmt.Errorf("prune: --batch must be at least 1, got %d", *batch)
	}
	cfg, _, pool, err := e.loadDB(ctx, *path)
	if err != nil {
		return err
	}
	defer pool.Close()
	store := pgtier.New(pool)
	if *reset {
		if err := store.ResetHorizon(ctx, cfg.Postgres.Retention, cfg.Consumer.ClockSkew); err != nil {
			return err
		}
	}
	n, cutoff, err := store.Prune(ctx, cfg.Postgres.Retention, cfg.Consumer.ClockSkew, *batch)
	if err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "pruned %d dedup rows processed before %s\n", n, cutoff.UTC().Format(time.RFC3339))
	return nil
}
