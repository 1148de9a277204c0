package cli

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"github.com/idemhq/idem/internal/layout"
	"github.com/idemhq/idem/internal/payments"
)

func runMigrate(ctx context.Context, e *Env, args []string) error {
	fs := NewFlags(e, "migrate", "Creates idem_processed and the payments tables in the first schema of\nDATABASE_URL's search_path, or on every database of postgres.shards, and\nrecords each shard's place in the list. Safe to run repeatedly and\nconcurrently.")
	path := fs.String("config", "", "YAML config `file`")
	if err := Parse(fs, args); err != nil {
		return err
	}
	_, _, dbs, err := e.LoadDB(ctx, *path)
	if err != nil {
		return err
	}
	defer dbs.Close()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for i, pool := range dbs {
		where := cmp.Or(dbs.name(i), "database")
		ran, err := payments.Migrate(ctx, pool)
		if err != nil {
			return fmt.Errorf("%s: %w", where, err)
		}
		if err := layout.CheckShard(ctx, pool, i, len(dbs)); err != nil {
			return fmt.Errorf("postgres.shards: %s: %w", where, err)
		}
		for _, m := range ran {
			fmt.Fprintf(e.Stdout, "%s: applied %04d_%s\n", where, m.Version, m.Name)
		}
		if len(ran) == 0 {
			fmt.Fprintf(e.Stdout, "%s is up to date\n", where)
		}
	}
	return nil
}
