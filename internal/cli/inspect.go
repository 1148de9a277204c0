package cli

import (
	"context"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemhq/idem/internal/fastkey"
	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/guard"
)

func runInspect(ctx context.Context, e *env, args []string) error {
	fs := newFlags(e, "inspect", `idem inspect [--config F] <eventId>

Shows, for one event ID in the configured scope, what each tier holds: the
Redis key (pending lease or done marker, payload hash, time to live), the
dedup row (when it was processed, payload hash) and the reference handler's
effect (ledger rows and the user's balance). With postgres.shards it looks on
every shard: an event ID alone does not say which shard its user maps to.`)
	path := fs.String("config", "", "YAML config `file`")
	// Flags may come before or after the event ID.
	var ids []string
	for rest := args; ; {
		if err := fs.Parse(rest); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return errHelp
			}
			return ErrUsage
		}
		if fs.NArg() == 0 {
			break
		}
		ids, rest = append(ids, fs.Arg(0)), fs.Args()[1:]
	}
	if len(ids) != 1 {
		fmt.Fprintln(e.stderr, "Usage: idem inspect [--config F] <eventId>")
		return ErrUsage
	}
	id := ids[0]
	if err := guard.ValidateID(id); err != nil {
		return fmt.Errorf("inspect: %w", err)
	}
	cfg, _, dbs, err := e.loadDB(ctx, *path)
	if err != nil {
		return err
	}
	defer dbs.Close()
	tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
	defer tw.Flush()
	fmt.Fprintf(tw, "event:\t%s (scope %s)\n", id, cfg.Scope)

	// Redis.
	if !cfg.Redis.Enabled {
		fmt.Fprintln(tw, "redis:\tnot in use (redis.enabled is false)")
	} else {
		rdb, err := cfg.RedisClient()
		if err != nil {
			return err
		}
		defer rdb.Close()
		key := fastkey.Key(cfg.Redis.Prefix, cfg.Scope, id)
		m, err := fastkey.Inspect(ctx, rdb, cfg.Redis.Prefix, cfg.Scope, id)
		switch {
		case err != nil:
			fmt.Fprintf(tw, "redis %s:\tunreachable: %v\n", key, err)
		case m.State == tier.FastDone:
			fmt.Fprintf(tw, "redis %s:\tdone, payload hash %s, expires in %s\n", key, hex.EncodeToString(m.Hash), m.TTL.Round(time.Second))
		case m.State == tier.FastPending:
			fmt.Fprintf(tw, "redis %s:\tpending: a consumer holds the lease, expires in %s\n", key, m.TTL.Round(time.Millisecond))
		default:
			fmt.Fprintf(tw, "redis %s:\tno key (never seen, expired, evicted or flushed)\n", key)
		}
	}

	var hash []byte
	rowsFound, n := 0, 0
	for i, pool := range dbs {
		on := ""
		if name := dbs.name(i); name != "" {
			on = " (" + name + ")"
		}
		// The dedup row.
		var at time.Time
		var h []byte
		err = pool.QueryRow(ctx, `SELECT processed_at, payload_hash FROM idem_processed WHERE scope = $1 AND event_id = $2`, cfg.Scope, id).Scan(&at, &h)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			if len(dbs) == 1 {
				fmt.Fprintln(tw, "dedup row:\tnone: not processed (or pruned past postgres.retention)")
			}
		case err != nil:
			return dbErr(err)
		default:
			hash = h
			rowsFound++
			fmt.Fprintf(tw, "dedup row%s:\tprocessed %s (%s ago), payload hash %s\n", on, at.UTC().Format(time.RFC3339Nano), time.Since(at).Round(time.Second), hex.EncodeToString(h))
		}

		// The reference handler's effect.
		rows, err := pool.Query(ctx, `SELECT user_id, amount, applied_at FROM payments_ledger WHERE event_id = $1 ORDER BY id`, id)
		if err != nil {
			return dbErr(err)
		}
		var users []string
		for rows.Next() {
			var user string
			var amount int64
			var applied time.Time
			if err := rows.Scan(&user, &amount, &applied); err != nil {
				return fmt.Errorf("database: %w", err)
			}
			n++
			users = append(users, user)
			fmt.Fprintf(tw, "ledger row %d%s:\tuser %s, amount %d, applied %s\n", n, on, user, amount, applied.UTC().Format(time.RFC3339Nano))
		}
		if err := rows.Err(); err != nil {
			return fmt.Errorf("database: %w", err)
		}
		if len(users) > 0 {
			var balance int64
			if err := pool.QueryRow(ctx, `SELECT balance FROM account_balances WHERE user_id = $1`, users[0]).Scan(&balance); err == nil {
				fmt.Fprintf(tw, "balance of %s%s:\t%d\n", users[0], on, balance)
			}
		}
	}
	if len(dbs) > 1 && rowsFound == 0 {
		fmt.Fprintf(tw, "dedup row:\tnone on any of %d shards: not processed (or pruned past postgres.retention)\n", len(dbs))
	}
	if rowsFound > 1 {
		fmt.Fprintf(tw, "verdict:\tDEDUP ROWS ON %d SHARDS: the ID came with userIds on different shards (a conflict sharding cannot see)\n", rowsFound)
		return nil
	}
	switch {
	case n == 0 && hash == nil:
		fmt.Fprintln(tw, "verdict:\tnot processed")
	case n == 1 && hash != nil:
		fmt.Fprintln(tw, "verdict:\tprocessed once")
	case n > 1:
		fmt.Fprintf(tw, "verdict:\tAPPLIED %d TIMES\n", n)
	case n == 0:
		fmt.Fprintln(tw, "verdict:\tdedup row without a ledger row (another handler's event, or the ledger was changed)")
	default:
		fmt.Fprintln(tw, "verdict:\tledger row without a dedup row (the row was pruned)")
	}
	return nil
}

// dbErr names the setting to look at, and the likely fix for missing tables.
func dbErr(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P01" {
		return fmt.Errorf("database_url: %w (no idem tables in this database and schema: run 'idem migrate', or point database_url at the consumers' schema)", err)
	}
	return fmt.Errorf("database: %w", err)
}
