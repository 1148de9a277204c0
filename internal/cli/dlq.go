package cli

import (
	"context"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/internal/config"
	"github.com/idemhq/idem/internal/dlq"
	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/pgsession"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/partition"
)

var dlqCommands = []Command{
	{"list", "count the dead letters by reason, with the oldest and newest", runDLQList},
	{"show", "print dead letters: reason, error, attempts, headers, body", runDLQShow},
	{"replay", "move dead letters back to the work queue with a fresh attempt budget", runDLQReplay},
	{"purge", "delete dead letters", runDLQPurge},
}

func runDLQ(ctx context.Context, e *Env, args []string) error {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		w := e.Stdout
		if len(args) == 0 {
			w = e.Stderr
		}
		fmt.Fprint(w, `Usage: idem dlq <command> [flags]

Works on the dead-letter queue of the queue (<queue>.dlq): --queue, else
the queue setting (IDEM_QUEUE, default payments.events). Every
command reads the messages there when it starts and leaves the others in
place; a message leaves the queue only once its command is done with it.

Commands:
`)
		for _, c := range dlqCommands {
			fmt.Fprintf(w, "  %-8s %s\n", c.Name, c.Summary)
		}
		fmt.Fprint(w, "\n'idem dlq <command> -h' shows a command's flags.\n")
		if len(args) == 0 {
			return ErrUsage
		}
		return nil
	}
	for _, c := range dlqCommands {
		if c.Name == args[0] {
			return c.Run(ctx, e, args[1:])
		}
	}
	fmt.Fprintf(e.Stderr, "idem dlq: unknown command %q (want list, show, replay or purge)\n", args[0])
	return ErrUsage
}

// dlqFilter selects dead letters by reason and event ID.
type dlqFilter struct {
	reason, event string
}

func (f *dlqFilter) flags(fs *flag.FlagSet) {
	fs.StringVar(&f.reason, "reason", "", "only dead letters with this `reason` (see 'idem dlq list')")
	fs.StringVar(&f.event, "event", "", "only dead letters of this event `id` (the body's eventId, else the message ID)")
}

func (f dlqFilter) match(m dlq.Message) bool {
	return (f.reason == "" || m.Reason == f.reason) && (f.event == "" || m.EventID == f.event)
}

// knownReasons are the dead-letter reasons idem writes: the runtime's, the
// broker's and the reference handler's.
func knownReasons() []string {
	return slices.Sorted(slices.Values(append(wire.Reasons(), payments.Reasons()...)))
}

// checkReason refuses, once a walk is over, a --reason that matched no dead
// letter and that idem never writes: a typo would select nothing and report
// success. A handler's own reason (Reject's) is taken as soon as a dead
// letter carries it, whatever the handler.
func checkReason(e *Env, cmd, reason string, matched int) error {
	if reason == "" || matched > 0 || slices.Contains(knownReasons(), reason) {
		return nil
	}
	return UsageErr(e, "idem %s: --reason %q matched no dead letter, and is not a reason idem writes (a handler's own reasons show in 'idem dlq list'); idem's are: %s",
		cmd, reason, strings.Join(knownReasons(), ", "))
}

// openDLQ reads the config and connects to the broker.
func (e *Env) openDLQ(ctx context.Context, path string) (config.Config, *dlq.Queue, error) {
	cfg, _, err := e.LoadConfig(path)
	if err != nil {
		return cfg, nil, err
	}
	q, err := dlq.Open(ctx, cfg.AMQPURL, cfg.Topology())
	if err != nil {
		return cfg, nil, amqpURLErr(err)
	}
	return cfg, q, nil
}

func runDLQList(ctx context.Context, e *Env, args []string) error {
	fs := NewFlags(e, "dlq list", "Counts the dead letters by reason, with the age of the oldest and newest\n(since they were dead-lettered).")
	path := fs.String("config", "", "YAML config `file`")
	e.targetFlags(fs, false, true)
	if err := Parse(fs, args); err != nil {
		return err
	}
	_, q, err := e.openDLQ(ctx, *path)
	if err != nil {
		return err
	}
	defer q.Close()
	type group struct {
		n              int
		oldest, newest time.Time
	}
	groups := map[string]*group{}
	n, err := q.Walk(ctx, func(m dlq.Message) (dlq.Verdict, error) {
		g := groups[m.Reason]
		if g == nil {
			g = &group{}
			groups[m.Reason] = g
		}
		g.n++
		widen(&g.oldest, &g.newest, m.DeadLetteredAt)
		return dlq.Keep, nil
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(e.Stdout, "%s: %d dead letters\n", q.DLQ, n)
	if n == 0 {
		return nil
	}
	now := time.Now()
	tw := tabwriter.NewWriter(e.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "REASON\tCOUNT\tOLDEST\tNEWEST\t")
	reasons := slices.Sorted(maps.Keys(groups))
	sort.SliceStable(reasons, func(i, j int) bool { return groups[reasons[i]].n > groups[reasons[j]].n })
	for _, r := range reasons {
		g := groups[r]
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t\n", inert(r), g.n, age(now, g.oldest), age(now, g.newest))
	}
	return tw.Flush()
}

// widen stretches the span oldest..newest to take in t, when t is known.
func widen(oldest, newest *time.Time, t time.Time) {
	if t.IsZero() {
		return
	}
	if oldest.IsZero() || t.Before(*oldest) {
		*oldest = t
	}
	if t.After(*newest) {
		*newest = t
	}
}

// age prints how long ago t was, rounded for reading; "?" if unknown.
func age(now, t time.Time) string {
	if t.IsZero() {
		return "?"
	}
	d := now.Sub(t)
	switch {
	case d < time.Minute:
		return d.Round(time.Second).String()
	case d < 48*time.Hour:
		return d.Round(time.Minute).String()
	}
	return fmt.Sprintf("%dd", int(d/(24*time.Hour)))
}

func runDLQShow(ctx context.Context, e *Env, args []string) error {
	fs := NewFlags(e, "dlq show", `Prints dead letters, oldest first: reason, error, attempts, replays,
headers and body. For a payload conflict it also prints when the original
was processed and both payload hashes, from the dedup rows of the scope
(--scope, else the scope setting).`)
	path := fs.String("config", "", "YAML config `file`")
	e.targetFlags(fs, true, true)
	var f dlqFilter
	f.flags(fs)
	limit := fs.Int("n", 10, "print at most `N` dead letters")
	if err := Parse(fs, args); err != nil {
		return err
	}
	if *limit < 1 {
		return UsageErr(e, "idem dlq show: -n must be at least 1, got %d", *limit)
	}
	cfg, q, err := e.openDLQ(ctx, *path)
	if err != nil {
		return err
	}
	defer q.Close()
	shown := 0
	var conflicts []dlq.Message
	_, err = q.Walk(ctx, func(m dlq.Message) (dlq.Verdict, error) {
		if !f.match(m) {
			return dlq.Keep, nil
		}
		shown++
		if m.Reason == wire.ReasonPayloadConflict {
			conflicts = append(conflicts, m)
		}
		printDeadLetter(e.Stdout, shown, m, time.Now())
		if shown >= *limit {
			return dlq.Stop, nil
		}
		return dlq.Keep, nil
	})
	if err != nil {
		return err
	}
	if err := checkReason(e, "dlq show", f.reason, shown); err != nil {
		return err
	}
	if shown == 0 {
		fmt.Fprintf(e.Stdout, "%s: no dead letter matches\n", q.DLQ)
	}
	if len(conflicts) > 0 {
		return e.showConflicts(ctx, cfg, conflicts)
	}
	return nil
}

func printDeadLetter(w io.Writer, n int, m dlq.Message, now time.Time) {
	d := m.D
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "--- dead letter %d\n", n)
	// Every text below is the producer's, or may be: each is inert.
	if m.EventIDRead {
		fmt.Fprintf(tw, "event_id:\t%s\n", inert(m.EventID))
	} else {
		// The message ID stands in for it in --event and replay's lines.
		fmt.Fprintf(tw, "event_id:\t(none read: the consumer did not decode one; the message ID stands in for it)\n")
	}
	fmt.Fprintf(tw, "message_id:\t%s\n", inert(d.MessageId))
	fmt.Fprintf(tw, "reason:\t%s\n", inert(m.Reason))
	if m.ByBroker {
		// Its x-idem-* headers, printed below with the others, are the
		// producer's: none of them was read.
		fmt.Fprintf(tw, "dead-lettered by:\tthe broker (x-death), not a consumer: its x-idem-* headers are the producer's\n")
	}
	fmt.Fprintf(tw, "error:\t%s\n", inert(m.Error))
	fmt.Fprintf(tw, "queue:\t%s\n", inert(m.Queue))
	fmt.Fprintf(tw, "attempts:\t%d\n", m.Attempts)
	fmt.Fprintf(tw, "replays:\t%d\n", m.Replays)
	if !m.DeadLetteredAt.IsZero() {
		fmt.Fprintf(tw, "dead-lettered:\t%s (%s ago)\n", m.DeadLetteredAt.UTC().Format(time.RFC3339), age(now, m.DeadLetteredAt))
	}
	if !d.Timestamp.IsZero() {
		fmt.Fprintf(tw, "timestamp:\t%s\n", d.Timestamp.UTC().Format(time.RFC3339))
	}
	if m.Truncated() {
		fmt.Fprintf(tw, "body:\t%s (the first %d of %d bytes)\n", inert(string(d.Body)), len(d.Body), m.BodyBytes)
	} else {
		fmt.Fprintf(tw, "body:\t%s\n", inert(string(d.Body)))
	}
	if m.HeadersDropped != "" {
		fmt.Fprintf(tw, "headers dropped:\t%s (left out to fit the broker's frame_max)\n", inert(m.HeadersDropped))
	}
	_ = tw.Flush()
	// The producer's headers, and the broker's x-death; not those printed
	// above, nor x-delivery-count, which counts this queue's reads. A
	// broker's dead letter's x-idem-* headers are the producer's: printed.
	for _, k := range slices.Sorted(maps.Keys(d.Headers)) {
		if k == "x-delivery-count" || !m.ByBroker && slices.Contains(shownHeaders, k) {
			continue
		}
		fmt.Fprintf(w, "header %s: %s\n", inert(k), inert(fmt.Sprint(d.Headers[k])))
	}
}

var shownHeaders = []string{wire.HeaderReason, wire.HeaderError, wire.HeaderQueue, wire.HeaderDeliveryCount,
	wire.HeaderDeadLetteredAt, wire.HeaderDeadLetterID, wire.HeaderEventID, dlq.HeaderReplays, dlq.HeaderPublishID, "x-delivery-count",
	wire.HeaderHeadersDropped}

// originalOf reads the dedup row a payload conflict collided with: when
// the original was processed and its payload hash. pgx.ErrNoRows: none.
func originalOf(ctx context.Context, cfg config.Config, dbs Shards, m dlq.Message) (time.Time, []byte, error) {
	var at time.Time
	var hash []byte
	// The conflict was found on the shard of the dead letter's key.
	pool := dbs[partition.Of(m.ShardKey, len(dbs))]
	err := pool.QueryRow(ctx, `SELECT processed_at, payload_hash FROM idem_processed WHERE scope = $1 AND event_id = $2`,
		cfg.Scope, m.EventID).Scan(&at, &hash)
	return at, hash, err
}

// showConflicts prints, for each payload conflict, the dedup row it
// collided with: when the original was processed and both hashes.
func (e *Env) showConflicts(ctx context.Context, cfg config.Config, ms []dlq.Message) error {
	dbs, err := OpenShards(ctx, cfg, pgsession.Bounds{})
	if err != nil {
		return err
	}
	defer dbs.Close()
	fmt.Fprintln(e.Stdout, "--- payload conflicts: the dedup rows they collided with")
	tw := tabwriter.NewWriter(e.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "EVENT_ID\tORIGINAL PROCESSED AT\tORIGINAL HASH\tDEAD LETTER'S HASH")
	for _, m := range ms {
		if m.EventID == "" {
			fmt.Fprintf(tw, "%s\t(the dead letter names no event)\t\t%s\n", inert(m.D.MessageId), inert(m.PayloadHash))
			continue
		}
		at, hash, err := originalOf(ctx, cfg, dbs, m)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			fmt.Fprintf(tw, "%s\t(no dedup row: pruned?)\t\t%s\n", inert(m.EventID), inert(m.PayloadHash))
		case err != nil:
			return dbErr(err)
		default:
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", inert(m.EventID), at.UTC().Format(time.RFC3339Nano), hex.EncodeToString(hash), inert(m.PayloadHash))
		}
	}
	return tw.Flush()
}

func runDLQReplay(ctx context.Context, e *Env, args []string) error {
	fs := NewFlags(e, "dlq replay", `Moves dead letters back to the work queue, oldest first, each with its
body, message ID, original timestamp (the event's time) and a fresh attempt
budget, and x-idem-replays counting its replays. Each leaves the dead-letter
queue only after the broker confirmed its re-publish. Only the dead letters
present when the command starts are replayed, so a replay that fails again
lands in the dead-letter queue once, not in a loop. The guard still decides:
replaying an event that was processed is a harmless duplicate. A dead
letter of reason body_too_large carries only the first bytes of its body:
it is never replayed (it stays, and the command exits 1). Say which:
--reason, --event or --all.`)
	path := fs.String("config", "", "YAML config `file`")
	e.targetFlags(fs, false, true)
	var f dlqFilter
	f.flags(fs)
	all := fs.Bool("all", false, "replay every dead letter")
	dry := fs.Bool("dry-run", false, "print what would be replayed, move nothing")
	if err := Parse(fs, args); err != nil {
		return err
	}
	if !*all && f.reason == "" && f.event == "" {
		return UsageErr(e, "idem dlq replay: say which dead letters: --reason R, --event ID, or --all")
	}
	_, q, err := e.openDLQ(ctx, *path)
	if err != nil {
		return err
	}
	defer q.Close()
	verb := "replayed"
	if *dry {
		verb = "would replay"
	}
	c, err := q.ReplayWhere(ctx, f.match, *dry, func(m dlq.Message, r dlq.Replayed) {
		if r == dlq.WasCut {
			// Its body was cut: a replay would publish a truncated event.
			fmt.Fprintf(e.Stdout, "not replayed %s (reason %s): it carries the first %d of its %d bytes\n",
				inert(m.EventID), inert(m.Reason), len(m.D.Body), m.BodyBytes)
			return
		}
		fmt.Fprintf(e.Stdout, "%s %s (reason %s, replays before: %d)\n", verb, inert(m.EventID), inert(m.Reason), m.Replays)
	})
	replayed, kept, truncated := c.Replayed, c.Kept, c.Cut
	if err == nil {
		// A partial walk still says what it did; an empty one with an
		// unknown reason says why.
		if err := checkReason(e, "dlq replay", f.reason, replayed); err != nil {
			return err
		}
	}
	fmt.Fprintf(e.Stdout, "%s %d dead letters to %s; %d others left in %s\n", verb, replayed, q.Work, kept, q.DLQ)
	if err == nil && truncated > 0 {
		// As for a replay that failed: exit 1, and they stay.
		return fmt.Errorf("dlq replay: refused %d dead letter(s) of reason %s: each carries only the first bytes of its body, and a replay would publish a truncated event. They stay in %s: have their producer send the events again within consumer.max_body_bytes (or raise it), then remove these with 'idem dlq purge --reason %s --yes'",
			truncated, wire.ReasonBodyTooLarge, q.DLQ, wire.ReasonBodyTooLarge)
	}
	return err
}

func runDLQPurge(ctx context.Context, e *Env, args []string) error {
	fs := NewFlags(e, "dlq purge", "Deletes dead letters for good: those with --reason, or every one. Needs --yes.")
	path := fs.String("config", "", "YAML config `file`")
	e.targetFlags(fs, false, true)
	reason := fs.String("reason", "", "only dead letters with this `reason`")
	yes := fs.Bool("yes", false, "really delete them")
	if err := Parse(fs, args); err != nil {
		return err
	}
	if !*yes {
		return UsageErr(e, "idem dlq purge: deleting dead letters cannot be undone; add --yes (see them first with 'idem dlq show')")
	}
	_, q, err := e.openDLQ(ctx, *path)
	if err != nil {
		return err
	}
	defer q.Close()
	purged := 0
	_, err = q.Walk(ctx, func(m dlq.Message) (dlq.Verdict, error) {
		if *reason != "" && m.Reason != *reason {
			return dlq.Keep, nil
		}
		purged++
		return dlq.Remove, nil
	})
	if err == nil {
		// A partial walk still says what it did; an empty one with an
		// unknown reason says why.
		if err := checkReason(e, "dlq purge", *reason, purged); err != nil {
			return err
		}
	}
	fmt.Fprintf(e.Stdout, "purged %d dead letters from %s\n", purged, q.DLQ)
	return err
}
