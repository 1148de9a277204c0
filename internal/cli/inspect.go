package cli

import (
	"cmp"
	"context"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/internal/config"
	"github.com/idemhq/idem/internal/fastkey"
	"github.com/idemhq/idem/internal/pgerr"
	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
)

func runInspect(ctx context.Context, e *Env, args []string) error {
	fs := NewFlags(e, "inspect", `idem inspect [--config F] [--scope S] <eventId>

Shows, for one event ID in the consuming service's scope (--scope, else the
scope setting), what each tier holds: the Redis key (pending lease or done
marker, payload hash, time to live), the dedup row (when it was processed,
payload hash), the messages it sent through the outbox (and whether each
was sent), and, where the reference payments handler's tables are in the
schema, its effect (ledger rows and the user's balance). It works for any
handler's database: without those tables it shows the guard's tiers alone.
With postgres.shards it looks on every shard: an event ID alone does not say
which shard its user maps to.

It refuses (exit 2) a scope of which the database holds no dedup or outbox
row, and names the scopes it finds: "not processed" would then only mean
that it looked in the wrong place.`)
	path := fs.String("config", "", "YAML config `file`")
	e.targetFlags(fs, true, false)
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
		fmt.Fprintln(e.Stderr, "Usage: idem inspect [--config F] [--scope S] <eventId>")
		return ErrUsage
	}
	id := ids[0]
	if err := guard.ValidateID(id); err != nil {
		return fmt.Errorf("inspect: %w", err)
	}
	cfg, _, dbs, err := e.LoadDB(ctx, *path)
	if err != nil {
		return err
	}
	defer dbs.Close()
	return inspectEvent(ctx, e, e.Stdout, cfg, dbs, id)
}

// inspectEvent writes to w what each tier holds for id: idem inspect's
// output, and the console's event page.
func inspectEvent(ctx context.Context, e *Env, w io.Writer, cfg config.Config, dbs Shards, id string) error {
	if err := checkScope(ctx, e, dbs, cfg.Scope, id); err != nil {
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	defer tw.Flush()
	fmt.Fprintf(tw, "event:\t%s (scope %s)\n", id, cfg.Scope)
	if err := inspectRedis(ctx, tw, cfg, id, dbs); err != nil {
		return err
	}
	var rows, applied int
	var effects bool
	for i, pool := range dbs {
		on := ""
		if name := dbs.name(i); name != "" {
			on = " (" + name + ")"
		}
		found, err := inspectDedupRow(ctx, tw, pool, cfg.Scope, id, on, len(dbs) == 1)
		if err != nil {
			return err
		}
		if found {
			rows++
		}
		replay := "idem outbox replay"
		if len(dbs) > 1 {
			replay += fmt.Sprintf(" --shard %d", i)
		}
		if err := inspectOutbox(ctx, tw, pool, cfg.Scope, id, on, replay); err != nil {
			return err
		}
		var n int
		var shown bool
		if q := cfg.Inspect.Effects; q != "" {
			n, shown, err = inspectDeclared(ctx, tw, pool, q, id, on)
		} else {
			n, shown, err = inspectPayment(ctx, tw, pool, id, on)
		}
		if err != nil {
			return err
		}
		applied, effects = applied+n, effects || shown
	}
	if len(dbs) > 1 && rows == 0 {
		fmt.Fprintf(tw, "dedup row:\tnone on any of %d shards: not processed (or pruned past postgres.retention)\n", len(dbs))
	}
	fmt.Fprintf(tw, "verdict:\t%s\n", inspectVerdict(rows, applied, effects))
	return nil
}

// maxScopesNamed is how many scopes checkScope names.
const maxScopesNamed = 10

// checkScope refuses a scope of which no database holds a dedup or an
// outbox row: the event would be "not processed" whatever happened to it
// (another service's scope, or a scope left to its default), so the
// operator is told which scopes there are instead. Both lookups are
// index scans (the tables' keys begin with the scope).
func checkScope(ctx context.Context, e *Env, dbs Shards, scope, id string) error {
	var found []string
	for _, pool := range dbs {
		outbox, err := hasTable(ctx, pool, "idem_outbox")
		if err != nil {
			return dbErr(err)
		}
		tables := []string{"idem_processed"}
		if outbox {
			tables = append(tables, "idem_outbox")
		}
		for _, table := range tables {
			var held bool
			if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+table+` WHERE scope = $1)`, scope).Scan(&held); err != nil {
				return dbErr(err)
			}
			if held {
				return nil
			}
			names, err := scopesIn(ctx, pool, table)
			if err != nil {
				return dbErr(err)
			}
			found = append(found, names...)
		}
	}
	slices.Sort(found)
	found = slices.Compact(found)
	where := "this database"
	if len(dbs) > 1 {
		where = fmt.Sprintf("any of the %d shards", len(dbs))
	}
	msg := fmt.Sprintf("idem inspect: no dedup or outbox row of scope %q in %s, so %s cannot be told from an event it never saw: give the consuming service's scope with --scope (or IDEM_SCOPE).", scope, where, id)
	switch {
	case len(found) == 0:
		msg += " The tables hold no row of any scope: is database_url the consumers' database and schema?"
	case len(found) > maxScopesNamed:
		msg += fmt.Sprintf(" Scopes found (the first %d by name): %s, …", maxScopesNamed, strings.Join(found[:maxScopesNamed], ", "))
	default:
		msg += " Scopes found: " + strings.Join(found, ", ")
	}
	return UsageErr(e, "%s", msg)
}

// scopesIn returns the first scopes of table by name, at most
// maxScopesNamed+1: one index probe per scope (a skip scan of the key that
// begins with it), however many rows each has.
func scopesIn(ctx context.Context, pool *pgxpool.Pool, table string) ([]string, error) {
	rows, err := pool.Query(ctx, `WITH RECURSIVE s(scope) AS (
			(SELECT scope FROM `+table+` ORDER BY scope LIMIT 1)
			UNION ALL
			SELECT (SELECT t.scope FROM `+table+` t WHERE t.scope > s.scope ORDER BY t.scope LIMIT 1)
			FROM s WHERE s.scope IS NOT NULL)
		SELECT scope FROM s WHERE scope IS NOT NULL LIMIT $1`, maxScopesNamed+1)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// hasTable reports whether table is on the pool's search_path: an older
// schema may lack one of idem's later tables.
func hasTable(ctx context.Context, pool *pgxpool.Pool, table string) (bool, error) {
	var present bool
	err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&present)
	return present, err
}

// inspectRedis prints the event's key in the fast tier, and whether the
// history its value names is that of a database now.
func inspectRedis(ctx context.Context, tw io.Writer, cfg config.Config, id string, dbs Shards) error {
	if !cfg.Redis.Enabled {
		fmt.Fprintln(tw, "redis:\tnot in use (redis.enabled is false)")
		return nil
	}
	rdb, err := cfg.RedisClient()
	if err != nil {
		return err
	}
	defer rdb.Close()
	key := inert(fastkey.Key(cfg.Redis.Prefix, cfg.Scope, id))
	m, err := fastkey.Inspect(ctx, rdb, cfg.Redis.Prefix, cfg.Scope, id)
	switch {
	case err != nil:
		fmt.Fprintf(tw, "redis %s:\tunreachable: %v\n", key, err)
		return nil
	case m.State == tier.FastDone:
		fmt.Fprintf(tw, "redis %s:\tdone, payload hash %s, expires in %s\n", key, hex.EncodeToString(m.Hash), m.TTL.Round(time.Second))
	case m.State == tier.FastPending:
		fmt.Fprintf(tw, "redis %s:\tpending lease (a consumer holds it, or held it and crashed), expires in %s\n", key, m.TTL.Round(time.Second))
	default:
		fmt.Fprintf(tw, "redis %s:\tno key (never claimed, expired, or evicted)\n", key)
		// A prefix or scope other than the consumers' finds nothing for
		// any event: say so rather than let "no key" pass for an answer.
		if found, known, err := fastkey.AnyOf(ctx, rdb, cfg.Redis.Prefix, cfg.Scope); err == nil && known && !found {
			fmt.Fprintf(tw, "redis:\tno key of scope %q under prefix %q at all: if the consumers run with another redis.prefix (IDEM_REDIS_PREFIX) or scope, give theirs; \"no key\" above says nothing of this event\n",
				inert(cfg.Scope), inert(cfg.Redis.Prefix))
		}
		return nil
	}
	fmt.Fprintf(tw, "marker history:\t%s\n", markerHistory(ctx, m, dbs, cfg.HistoryWithout()))
	return nil
}

// markerHistory says whether the history a marker names is that of one of
// the databases now: a guard trusts a done marker only then; otherwise the
// database that committed it has since failed over, been restored or been
// re-created, and the next copy of the event goes to PostgreSQL, which
// decides.
func markerHistory(ctx context.Context, m fastkey.Marker, dbs Shards, without []string) string {
	switch {
	case m.History == "" && m.State == tier.FastPending:
		return "none (taken before its holder knew the database's history)"
	case m.History == "":
		return "none (written before idem named histories): counts as absent"
	}
	mh := inert(string(m.History)) // whoever can write the key wrote it
	var now, unread []string
	for i, pool := range dbs {
		st, err := pgtier.NewWith(pool, pgtier.Options{HistoryWithout: without}) // as the consumers read it
		if err != nil {
			return err.Error()
		}
		h, err := st.History(ctx)
		if err != nil {
			unread = append(unread, fmt.Sprintf("%s could not be read: %v", cmp.Or(dbs.name(i), "the database's"), dbErr(err)))
			continue
		}
		if m.History.Confirms(h) {
			if m.State == tier.FastPending {
				return fmt.Sprintf("%s, the database's now", mh)
			}
			if name := dbs.name(i); name != "" {
				return fmt.Sprintf("%s, %s's now: trusted by a consumer whose event maps to %s", mh, name, name)
			}
			return fmt.Sprintf("%s, the database's now: trusted", mh)
		}
		now = append(now, string(h))
	}
	if len(now) == 0 {
		return fmt.Sprintf("%s (%s)", mh, strings.Join(unread, "; "))
	}
	if m.State == tier.FastPending {
		return fmt.Sprintf("%s, not the database's now (%s): the history its holder knew; a lease holds whatever its history until it expires", mh, strings.Join(now, ", "))
	}
	return fmt.Sprintf("%s, not the database's now (%s): the database failed over, was restored or re-created since; the marker counts as absent and the next copy goes to PostgreSQL", mh, strings.Join(now, ", "))
}

// inspectDedupRow prints the event's dedup row in one database and reports
// whether there is one. alone says the database is the only one, where no
// row is worth a line.
func inspectDedupRow(ctx context.Context, tw io.Writer, pool *pgxpool.Pool, scope, id, on string, alone bool) (bool, error) {
	var at time.Time
	var h []byte
	err := pool.QueryRow(ctx, `SELECT processed_at, payload_hash FROM idem_processed WHERE scope = $1 AND event_id = $2`, scope, id).Scan(&at, &h)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		if alone {
			fmt.Fprintln(tw, "dedup row:\tnone: not processed (or pruned past postgres.retention)")
		}
		return false, nil
	case err != nil:
		return false, dbErr(err)
	}
	fmt.Fprintf(tw, "dedup row%s:\tprocessed %s (%s ago), payload hash %s\n", on, at.UTC().Format(time.RFC3339Nano), time.Since(at).Round(time.Second), hex.EncodeToString(h))
	return true, nil
}

// inspectOutbox prints the messages the event sent through the outbox, and
// whether each was sent.
// replay is the command that replays one of its rows (with --shard where
// there are several).
func inspectOutbox(ctx context.Context, tw io.Writer, pool *pgxpool.Pool, scope, id, on, replay string) error {
	present, err := hasTable(ctx, pool, "idem_outbox")
	if err != nil {
		return dbErr(err)
	}
	if !present {
		return nil // an older schema sends nothing
	}
	msgs, err := relay.List(ctx, pool, relay.Filter{Scope: scope, EventID: id})
	if err != nil {
		return dbErr(err)
	}
	for _, m := range msgs {
		fmt.Fprintf(tw, "outgoing %d%s:	message %s to %s, key %q: %s\n", m.Index, on, inert(m.MessageID), m.Destination, m.Key, describeMessage(m, replay))
	}
	return nil
}

// describeMessage says where an outbox row stands.
func describeMessage(m relay.Message, replay string) string {
	switch {
	case m.State == "sent" && m.SentAt != nil:
		return fmt.Sprintf("sent %s, %s after its commit, attempt %d", m.SentAt.UTC().Format(time.RFC3339Nano), m.SentAt.Sub(m.CreatedAt).Round(time.Millisecond), m.Attempts)
	case m.State == "dead":
		return fmt.Sprintf("DEAD after %d attempt(s): %s (%s --id %d)", m.Attempts, inert(m.LastError), replay, m.ID)
	case m.Attempts > 0:
		return fmt.Sprintf("pending, %d failed attempt(s), last: %s", m.Attempts, inert(m.LastError))
	}
	return fmt.Sprintf("pending since %s", m.CreatedAt.UTC().Format(time.RFC3339Nano))
}

// inspectPayment prints the reference handler's effect of the event, if
// its tables are in the schema: ledger rows and the user's balance. It
// returns how many ledger rows there are and whether it could look.
func inspectPayment(ctx context.Context, tw io.Writer, pool *pgxpool.Pool, id, on string) (int, bool, error) {
	var present bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass('payments_ledger') IS NOT NULL`).Scan(&present); err != nil {
		return 0, false, dbErr(err)
	}
	if !present {
		// Another handler's tables, and inspect.effects does not say how
		// to show them: the tiers above say whether the event committed.
		return 0, false, nil
	}
	rows, err := pool.Query(ctx, `SELECT user_id, amount, applied_at FROM payments_ledger WHERE event_id = $1 ORDER BY id`, id)
	if err != nil {
		return 0, true, dbErr(err)
	}
	n, user := 0, ""
	for rows.Next() {
		var amount int64
		var applied time.Time
		if err := rows.Scan(&user, &amount, &applied); err != nil {
			return n, true, fmt.Errorf("database: %w", err)
		}
		n++
		fmt.Fprintf(tw, "ledger row %d%s:\tuser %s, amount %d, applied %s\n", n, on, user, amount, applied.UTC().Format(time.RFC3339Nano))
	}
	if err := rows.Err(); err != nil {
		return n, true, fmt.Errorf("database: %w", err)
	}
	if n > 0 {
		var balance int64
		if err := pool.QueryRow(ctx, `SELECT balance FROM account_balances WHERE user_id = $1`, user).Scan(&balance); err == nil {
			fmt.Fprintf(tw, "balance of %s%s:\t%d\n", user, on, balance)
		}
	}
	return n, true, nil
}

// inspectDeclared prints the rows the service's own query (inspect.effects)
// returns for the event, in a READ ONLY transaction: one row per time the
// effect was applied.
func inspectDeclared(ctx context.Context, tw io.Writer, pool *pgxpool.Pool, query, id, on string) (int, bool, error) {
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
	if err != nil {
		return 0, false, dbErr(err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	rows, err := tx.Query(ctx, query, id)
	if err != nil {
		return 0, false, fmt.Errorf("inspect.effects: %w", dbErr(err))
	}
	defer rows.Close()
	fields := rows.FieldDescriptions()
	n := 0
	for rows.Next() {
		vals, err := rows.Values()
		if err != nil {
			return n, true, fmt.Errorf("inspect.effects: %w", err)
		}
		var cols []string
		for k, f := range fields {
			cols = append(cols, fmt.Sprintf("%s %v", f.Name, vals[k]))
		}
		n++
		// The service's data: inert, as anything a producer may have written.
		fmt.Fprintf(tw, "effect row %d%s:\t%s\n", n, on, inert(strings.Join(cols, ", ")))
	}
	if err := rows.Err(); err != nil {
		return n, true, fmt.Errorf("inspect.effects: %w", dbErr(err))
	}
	return n, true, nil
}

// inspectVerdict sums up: rows is dedup rows found (on how many shards),
// applied the ledger rows, effects whether they could be looked at.
func inspectVerdict(rows, applied int, effects bool) string {
	switch {
	case rows > 1:
		return fmt.Sprintf("DEDUP ROWS ON %d SHARDS: the ID came with keys on different shards (a conflict sharding cannot see)", rows)
	case !effects && rows == 1:
		return "processed: its dedup row committed, with the handler's effect in the same transaction"
	case !effects:
		return "not processed"
	case applied == 0 && rows == 0:
		return "not processed"
	case applied == 1 && rows == 1:
		return "processed once"
	case applied > 1:
		return fmt.Sprintf("APPLIED %d TIMES", applied)
	case applied == 0:
		return "dedup row without a ledger row (another handler's event, or the ledger was changed)"
	}
	return "ledger row without a dedup row (the row was pruned)"
}

// dbErr names the setting to look at, and the likely fix for missing tables.
func dbErr(err error) error {
	if pgerr.SQLState(err) == pgerr.UndefinedTable {
		return unmigrated(err)
	}
	return fmt.Errorf("database: %w", err)
}

// unmigrated says what a tool's missing table most likely means, or
// returns err as it is.
func unmigrated(err error) error {
	if pgerr.SQLState(err) == pgerr.UndefinedTable {
		return fmt.Errorf("database_url: idem's tables are missing in this database (in the first schema of its search_path): run `idem migrate`, or point database_url at the consumers' schema (%w)", err)
	}
	return err
}
