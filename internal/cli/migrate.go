package cli

import (
	"context"
	"fmt"
	"time"

	"github.com/idemhq/idem/internal/payments"
)

func runMigrate(ctx context.Context, e *env, args []string) error {
	fs := newFlags(e, "migrate", "Creates idem_processed and the payments tables in the first schema of\nDATABASE_URL's search_path. Safe to run repeatedly and concurrently.")
	path := fs.String("config", "", "YAML config `file`")
	if err := parse(fs, args); err != nil {
		return err
	}
	_, _, pool, err := e.loadDB(ctx, *path)
	if err != nil {
		return err
	}
	defer pool.Close()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	ran, err := payments.Migrate(ctx, pool)
	if err != nil {
		return err
	}
	for _, m := range ran {
		fmt.Fprintf(e.stdout, "applied %04d_%s\n", m.Version, m.Name)
	}
	if len(ran) == 0 {
		fmt.Fprintln(e.stdout, "database is up to date")
	}
	return nil
}
