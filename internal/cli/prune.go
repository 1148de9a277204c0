package cli

import (
	"context"
	"fmt"

	"github.com/idemhq/idem/pkg/guard/pgtier"
)

func runPrune(ctx context.Context, e *env, args []string) error {
	fs := newFlags(e, "prune", "Deletes dedup rows older than postgres.retention. Consumers refuse messages\npublished longer ago than that, so pruning never lets a replay through twice.")
	path := fs.String("config", "", "YAML config `file`")
	batch := fs.Int("batch", 10000, "rows deleted per statement")
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
	n, err := pgtier.New(pool).Prune(ctx, cfg.Postgres.Retention, *batch)
	if err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "pruned %d dedup rows older than %s\n", n, cfg.Postgres.Retention)
	return nil
}
