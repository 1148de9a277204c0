package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemhq/idem/internal/config"
	"github.com/idemhq/idem/internal/heartbeat"
	"github.com/idemhq/idem/internal/pgsession"
	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/telemetry"
	"github.com/idemhq/idem/migrations"
)

func runRelay(ctx context.Context, e *Env, args []string) error {
	fs := NewFlags(e, "relay", `Publishes the outbox until SIGTERM or SIGINT: the messages handlers enqueued
in their events' transactions (idem_outbox), to outbox.destinations, with
publisher confirms (or an HTTP POST with an Idempotency-Key), marking each
sent once confirmed. Run as many as you like: they share the outbox's lanes,
and the messages of one key leave in order. With postgres.shards, one relay
per shard runs in this process. Applies idem's pending migrations at start.

An HTTP destination's requests carry the headers outbox.headers gives it
(mailer:Authorization=env:MAILER_AUTH: the value read from MAILER_AUTH at
start, masked in every output; a literal value is refused). Basic auth in
its URL (a user and password before the host) works too, the password
masked.

At start it refuses (exit 2) pending outbox rows whose destination
outbox.destinations does not name, with their count per destination (among
the oldest `+strconv.Itoa(pendingChecked)+` pending rows of each database): a relay would make each
dead at once. Add each to outbox.destinations; the rows stay pending.`)
	path := fs.String("config", "", "YAML config `file`")
	host, _ := os.Hostname()
	name := fs.String("name", fmt.Sprintf("idem-relay-%s-%d", host, os.Getpid()), "client-provided RabbitMQ connection `name`")
	noMigrate := fs.Bool("no-migrate", false, "do not apply pending migrations at start; refuse to start if one is missing")
	statsFile := fs.String("stats-file", "", "write the relay's counts as JSON to this `file` every second and on exit")
	if err := Parse(fs, args); err != nil {
		return err
	}
	TuneGC(e.Getenv) // a pass's rows are its live heap, as a batch is a consumer's
	cfg, log, dbs, err := e.LoadDBFor(ctx, *path, RelayBounds)
	if err != nil {
		return err
	}
	defer dbs.Close()
	if cfg.Outbox.Destinations == "" {
		return errors.New("outbox.destinations: empty; a relay needs somewhere to send (see idem relay -h and the README)")
	}
	if !*noMigrate {
		if err := migrateGuard(ctx, dbs); err != nil {
			return err
		}
	} else if err := requireMigrated(ctx, cfg, dbs, log, migrations.Guard); err != nil {
		return err
	}
	if err := checkDestinations(ctx, cfg, dbs, log); err != nil {
		return err
	}
	reg := telemetry.NewRegistry()
	rs, err := newRelays(cfg, dbs, reg, log, *name)
	if err != nil {
		return err
	}
	if cfg.MetricsAddr != "" {
		stop, err := serveTelemetry(ctx, cfg.MetricsAddr, telemetry.Handler(reg, relay.Health(rs)), log)
		if err != nil {
			return err
		}
		defer stop()
	}
	if *statsFile != "" {
		stop := telemetry.WriteStatsEvery(*statsFile, time.Second, func() any {
			snap, err := telemetry.Snapshot(reg)
			if err != nil {
				log.Error("read metrics", "err", err)
			}
			return snap
		}, func(err error) { log.Error("write stats file", "err", err) })
		defer stop()
	}
	log.Info("relaying", "destinations", relay.Names(cfg.RelayConfig().Destinations), "shards", len(dbs))
	hctx, stopBeat := context.WithCancel(ctx)
	beating := make(chan struct{})
	go func() {
		defer close(beating)
		if cfg.Heartbeat <= 0 {
			return
		}
		heartbeat.Run(hctx, dbs[0], heartbeat.Instance(*name), cfg.Heartbeat, func(ctx context.Context) heartbeat.Report {
			ready, body := relay.ReadyLines(ctx, rs)
			why := ""
			if !ready {
				why = strings.TrimSpace(strings.SplitN(body, "\n", 2)[0])
			}
			return heartbeat.Report{Kind: "relay", Queue: strings.Join(relay.Names(cfg.RelayConfig().Destinations), ","), Ready: ready, Why: why}
		}, log)
	}()
	relay.RunAll(ctx, rs)
	stopBeat()
	<-beating
	log.Info("stopped")
	return nil
}

// migrateGuard applies idem's own migrations on every shard.
func migrateGuard(ctx context.Context, dbs Shards) error {
	for i, pool := range dbs {
		if _, err := migrations.Apply(ctx, pool); err != nil {
			if len(dbs) > 1 {
				return fmt.Errorf("shard %d: %w", i, err)
			}
			return err
		}
	}
	return nil
}

// newRelays returns a relay per shard, sharing one set of metrics on reg.
func newRelays(cfg config.Config, dbs Shards, reg prometheus.Registerer, log *slog.Logger, name string) ([]*relay.Relay, error) {
	rc := cfg.RelayConfig()
	m, err := relay.NewMetrics(reg, relay.Names(rc.Destinations))
	if err != nil {
		return nil, err
	}
	rc.Metrics, rc.Name, rc.Logger = m, name, log
	return relay.PerShard(rc, dbs)
}

// withRelayHealth adds the relays' lines to the /readyz of idem consume,
// reported but not required: a destination that fails does not make a
// consumer that consumes unready (idem relay alone requires them). The
// backlogs are read at most once a second (telemetry.ReadyCache).
func withRelayHealth(h http.Handler, rs []*relay.Relay) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/", h)
	mux.Handle("/readyz", telemetry.CacheReady(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		_, lines := relay.ReadyLines(r.Context(), rs)
		lines = strings.Replace(lines, "relay: failing: ", "relay: failing (not required): ", 1)
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(rec.Code)
		fmt.Fprint(w, rec.Body.String()+lines)
	})))
	return mux
}

func runOutbox(ctx context.Context, e *Env, args []string) error {
	const usage = `Usage: idem outbox list [--state S | --dead | --pending] [--scope S] [--destination D] [-n N] [--shard S] [--config F]
       idem outbox replay (--id N[,N…] | --all-dead) [--scope S] [--destination D] [--shard S] [--config F]
       idem outbox resend --destination D --since T [--scope S] [--shard S] [--dry-run] [--config F]

list shows the destinations a relay has paused (distinct rows failed alike:
their rows stay pending and spend no attempt while one row probes), then
outbox rows, oldest first: message ID, event, destination, state, attempts
and the last error. replay makes dead rows pending again with a
fresh attempt budget; the relay publishes them with their original message
IDs, so a receiver that already took one drops it. --scope and
--destination keep to one service's rows and one destination's, in each.

resend makes sent rows pending again, for messages lost after their
destination took them: a queue deleted with its messages in it, a receiver
restored from a backup. It takes the rows of one destination sent since T
(a duration back from now, 15m, or an RFC 3339 time) that are still kept
(outbox.retention); the relay sends them again with their original message IDs and
Idempotency-Keys, so a receiver that still has one drops it as a duplicate.
A receiver that honours neither acts on them again: resend only to one that
deduplicates.

With postgres.shards, each shard numbers its rows: list shows a row's ID as
"shard S: N", and replay --id N needs --shard S. replay --all-dead replays
every shard's dead rows, or with --shard S only that shard's.`
	if len(args) == 0 || (args[0] != "list" && args[0] != "replay" && args[0] != "resend") {
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help") {
			fmt.Fprintln(e.Stdout, usage)
			return nil
		}
		fmt.Fprintln(e.Stderr, usage)
		return ErrUsage
	}
	cmd := "idem outbox " + args[0]
	fs := NewFlags(e, "outbox "+args[0], usage)
	path := fs.String("config", "", "YAML config `file`")
	dead := fs.Bool("dead", false, "list: only dead rows (--state dead)")
	pending := fs.Bool("pending", false, "list: only pending rows (--state pending)")
	stateFlag := fs.String("state", "", "list: only rows in `state` pending, sent or dead")
	scope := fs.String("scope", "", "only the rows of `scope` (a service's consumer.scope)")
	dest := fs.String("destination", "", "only the rows for destination `name`")
	n := fs.Int("n", 100, "list: most rows (per shard)")
	ids := fs.String("id", "", "replay: the rows' ids (the first column of list), separated by commas")
	all := fs.Bool("all-dead", false, "replay: every dead row")
	shard := fs.Int("shard", -1, "only shard `S` of postgres.shards (counted from 0); replay --id needs it when there are several")
	sinceFlag := fs.String("since", "", "resend: the rows sent since `T`: a duration back from now (15m) or an RFC 3339 time")
	dry := fs.Bool("dry-run", false, "resend: count the rows it would resend, change nothing")
	if err := Parse(fs, args[1:]); err != nil {
		return err
	}
	var since relay.Since
	if args[0] == "resend" {
		switch {
		case *dest == "":
			return UsageErr(e, "%s: give --destination: the rows of one destination are resent", cmd)
		case *sinceFlag == "":
			return UsageErr(e, "%s: give --since: a duration back from now (15m) or an RFC 3339 time", cmd)
		}
		if d, err := time.ParseDuration(*sinceFlag); err == nil && d > 0 {
			since.Back = d // from the database's clock, which stamped sent_at
		} else if t, err := time.Parse(time.RFC3339, *sinceFlag); err == nil {
			since.At = t
		} else {
			return UsageErr(e, "%s: --since %q: want a positive duration (15m) or an RFC 3339 time (2026-12-05T07:00:00Z)", cmd, *sinceFlag)
		}
	}
	var rowIDs []int64
	if args[0] == "replay" {
		if (*ids == "") == !*all {
			return UsageErr(e, "%s: give --id or --all-dead, not both or neither", cmd)
		}
		var err error
		if rowIDs, err = parseIDs(*ids); err != nil {
			return UsageErr(e, "%s: --id: %v", cmd, err)
		}
		if !*all && len(rowIDs) == 0 {
			// An empty list must not reach Replay, which takes it as every row.
			return UsageErr(e, "%s: --id %q names no row (to replay every dead row, give --all-dead)", cmd, *ids)
		}
	}
	cfg, _, err := e.LoadConfig(*path)
	if err != nil {
		return err
	}
	shards := len(cfg.DatabaseURLs())
	switch {
	case *shard >= shards || *shard < -1:
		return UsageErr(e, "%s: --shard %d: postgres.shards lists %d shard(s), numbered from 0", cmd, *shard, shards)
	case len(rowIDs) > 0 && shards > 1 && *shard < 0:
		// Each shard numbers its rows from 1: row N exists on every shard.
		return UsageErr(e, "%s: --id: row ids are per shard and postgres.shards lists %d; add --shard S (list shows a row as \"shard S: N\")", cmd, shards)
	}
	dbs, err := OpenShards(ctx, cfg, pgsession.Bounds{})
	if err != nil {
		return err
	}
	defer dbs.Close()
	if args[0] == "resend" {
		verb := "pending again"
		if *dry {
			verb = "would be pending again"
		}
		window := "sent in the last " + since.Back.String()
		if since.Back == 0 {
			window = "sent since " + since.At.UTC().Format(time.RFC3339)
		}
		if keep := cfg.Outbox.Retention; keep <= 0 || since.Back > keep || (since.Back == 0 && time.Since(since.At) > keep) {
			fmt.Fprintf(e.Stderr, "%s: note: relays keep sent rows outbox.retention (%s here) after they went, then delete them: those sent before are not resent\n", cmd, keep)
		}
		for i, pool := range dbs {
			if *shard >= 0 && i != *shard {
				continue
			}
			k, err := relay.Resend(ctx, pool, relay.Filter{Scope: *scope, Destination: *dest}, since, *dry)
			if err != nil {
				return dbErr(err)
			}
			fmt.Fprintf(e.Stdout, "%s%d row(s) of %s %s %s\n", shardPrefix(dbs, i), k, inert(*dest), window, verb)
		}
		return nil
	}
	if args[0] == "replay" {
		for i, pool := range dbs {
			if *shard >= 0 && i != *shard {
				continue
			}
			k, err := relay.ReplayWhere(ctx, pool, relay.Filter{IDs: rowIDs, Scope: *scope, Destination: *dest})
			if err != nil {
				return dbErr(err)
			}
			fmt.Fprintf(e.Stdout, "%s%d dead row(s) pending again\n", shardPrefix(dbs, i), k)
		}
		return nil
	}
	state := *stateFlag
	switch {
	case state != "" && !slices.Contains(relay.States, state):
		return UsageErr(e, "%s: --state %q: want one of %s", cmd, state, strings.Join(relay.States, ", "))
	case btoi(*dead)+btoi(*pending)+btoi(state != "") > 1:
		return UsageErr(e, "%s: one of --state, --dead and --pending", cmd)
	case *dead:
		state = "dead"
	case *pending:
		state = "pending"
	}
	paused := map[string]bool{} // by shard prefix and destination
	pw := tabwriter.NewWriter(e.Stdout, 0, 0, 2, ' ', 0)
	header := false
	for i, pool := range dbs {
		if *shard >= 0 && i != *shard {
			continue
		}
		ps, updated, err := relay.ReadPauses(ctx, pool)
		if err != nil {
			return dbErr(err)
		}
		for k, p := range ps {
			if *dest != "" && p.Destination != *dest {
				continue
			}
			if !header {
				fmt.Fprintln(pw, "PAUSED\tBY RELAY\tSINCE\tCLASS\tPROBES FAILED\tNEXT PROBE\tWRITTEN\tLAST ERROR")
				header = true
			}
			paused[shardPrefix(dbs, i)+p.Destination] = true
			fmt.Fprintf(pw, "%s%s\t%s\t%s ago\t%s\t%d\t%s\t%s ago\t%s\n", shardPrefix(dbs, i), inert(p.Destination), inert(p.Relay),
				time.Since(p.Since).Round(time.Second), inert(p.Class), p.Probes, probeIn(p.NextProbe),
				time.Since(updated[k]).Round(time.Second), inert(e.red.String(p.LastError)))
		}
	}
	if header {
		_ = pw.Flush()
		fmt.Fprintln(e.Stdout, "(a paused destination's rows stay pending and spend no attempt; it resumes by itself once a probe is answered)")
		fmt.Fprintln(e.Stdout)
	}
	tw := tabwriter.NewWriter(e.Stdout, 0, 0, 2, ' ', 0)
	defer tw.Flush()
	fmt.Fprintln(tw, "ID\tMESSAGE ID\tSCOPE/EVENT\tTO\tKEY\tSTATE\tATTEMPTS\tAGE\tLAST ERROR")
	for i, pool := range dbs {
		if *shard >= 0 && i != *shard {
			continue
		}
		msgs, err := relay.List(ctx, pool, relay.Filter{State: state, Scope: *scope, Destination: *dest, Limit: *n})
		if err != nil {
			return dbErr(err)
		}
		for _, m := range msgs {
			if m.State == "pending" && paused[shardPrefix(dbs, i)+m.Destination] {
				m.State = "pending (paused)"
			}
			// The error may quote an HTTP destination's URL (rows written
			// before the relay masked it): masked here, before the columns
			// are aligned, rather than by the output's redactor after.
			fmt.Fprintf(tw, "%s%d\t%s\t%s/%s#%d\t%s\t%s\t%s\t%d\t%s\t%s\n", shardPrefix(dbs, i), m.ID, inert(m.MessageID), m.Scope, inert(m.EventID), m.Index,
				m.Destination, inert(m.Key), m.State, m.Attempts, time.Since(m.CreatedAt).Round(time.Second), inert(e.red.String(m.LastError)))
		}
	}
	return nil
}

// probeIn says when a paused destination's next probe is due.
func probeIn(at time.Time) string {
	if d := time.Until(at); d > 0 {
		return "in " + d.Round(100*time.Millisecond).String()
	}
	return "due"
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

func shardPrefix(dbs Shards, i int) string {
	if len(dbs) == 1 {
		return ""
	}
	return dbs.name(i) + ": "
}

func parseIDs(s string) ([]int64, error) {
	var out []int64
	for f := range strings.SplitSeq(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		v, err := strconv.ParseInt(f, 10, 64)
		if err != nil || v < 1 {
			return nil, fmt.Errorf("%q is not a row id", f)
		}
		out = append(out, v)
	}
	return out, nil
}

// waitForOutbox waits until every database has idem_outbox (the service's
// start-up migrates), so that a relay started beside a consumer does not
// log failures meanwhile.
func waitForOutbox(ctx context.Context, dbs Shards) {
	for _, pool := range dbs {
		for ctx.Err() == nil {
			var present bool
			if err := pool.QueryRow(ctx, `SELECT to_regclass('idem_outbox') IS NOT NULL`).Scan(&present); err == nil && present {
				break
			}
			select {
			case <-ctx.Done():
			case <-time.After(200 * time.Millisecond):
			}
		}
	}
}
