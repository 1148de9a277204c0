package cli

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/idemhq/idem/internal/config"
	"github.com/idemhq/idem/internal/layout"
	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/pgerr"
	"github.com/idemhq/idem/migrations"
)

func runMigrate(ctx context.Context, e *Env, args []string) error {
	fs := NewFlags(e, "migrate", `Creates or updates idem's own tables (idem_processed, idem_horizon,
idem_shard, idem_stream, idem_outbox*; set idem_migrations) in the first
schema of DATABASE_URL's search_path, or on every database of
postgres.shards, and records each shard's place in the list. The reference
handlers' tables (payments_ledger, account_balances, receipts; set
payments_migrations) only when the handler setting (IDEM_HANDLER) names one:
a service's database gets idem's tables and nothing else. It says which
sets it applied. Safe to run repeatedly and concurrently.`)
	path := fs.String("config", "", "YAML config `file`")
	if err := Parse(fs, args); err != nil {
		return err
	}
	cfg, _, dbs, err := e.LoadDB(ctx, *path)
	if err != nil {
		return err
	}
	defer dbs.Close()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	sets := migrationSets(cfg)
	var names []string
	for _, set := range sets {
		names = append(names, set.Ledger)
	}
	for i, pool := range dbs {
		where := cmp.Or(dbs.name(i), "database")
		for _, set := range sets {
			ran, err := migrations.ApplySet(ctx, pool, set)
			if err != nil {
				return fmt.Errorf("%s: %s: %w", where, set.Ledger, err)
			}
			for _, m := range ran {
				fmt.Fprintf(e.Stdout, "%s: applied %s %04d_%s\n", where, set.Ledger, m.Version, m.Name)
			}
		}
		if err := layout.CheckShard(ctx, pool, i, len(dbs)); err != nil {
			return fmt.Errorf("postgres.shards: %s: %w", where, err)
		}
		fmt.Fprintf(e.Stdout, "%s is up to date: %s\n", where, strings.Join(names, ", "))
	}
	if cfg.Handler == "" {
		fmt.Fprintf(e.Stdout, "not applied: %s (the reference handlers' tables; handler is not set, IDEM_HANDLER=payments applies it)\n", payments.Migrations.Ledger)
	}
	return nil
}

// migrationSets are the sets idem migrate applies: idem's own, and the
// reference handlers' when the handler setting names one. (idem consume
// applies both whatever the setting: it runs a reference handler.)
func migrationSets(cfg config.Config) []migrations.Set {
	if cfg.Handler == "" {
		return []migrations.Set{migrations.Guard}
	}
	return []migrations.Set{migrations.Guard, payments.Migrations}
}

// requireMigrated stops a command started with --no-migrate on a database
// (of any shard) where one of sets is not applied, saying so plainly
// rather than as a table missing in a later check. It waits, as the
// start-up does, for a database that is not up yet.
func requireMigrated(ctx context.Context, cfg config.Config, dbs Shards, log *slog.Logger, sets ...migrations.Set) error {
	for i, pool := range dbs {
		what := "checking the migrations"
		if name := dbs.name(i); name != "" {
			what += " on " + name
		}
		var missing *layout.UnmigratedError
		err := pgerr.Wait(ctx, cfg.Consumer.StartupTimeout, what, log, func(ctx context.Context) error {
			err := layout.CheckMigrated(ctx, pool, sets...)
			if errors.As(err, &missing) {
				return nil // not the database's fault: no retry
			}
			return err
		})
		if err != nil {
			return err
		}
		if missing != nil {
			remedy := "run `idem migrate`, or start without --no-migrate"
			if !missing.Own() {
				remedy = "run `idem migrate` with the handler setting (IDEM_HANDLER=payments), or start without --no-migrate"
			}
			return fmt.Errorf("%s%w: %s", shardPrefix(dbs, i), missing, remedy)
		}
	}
	return nil
}
