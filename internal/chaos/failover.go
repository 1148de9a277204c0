package chaos

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/loadgen"
	"github.com/idemhq/idem/internal/sandbox"
)

// A pg-failover run's shard 0 is a sandbox.Pair: a primary and a streaming
// standby behind a front link, which every consumer's Postgres link (and
// the run's own pools) lead to, so that the links the other Postgres kinds
// break follow each promotion. A failover cuts the standby off, lets the
// primary live on for the fault's duration, kills it, promotes the
// standby, re-points the front and gives the new primary a standby of its
// own, for the next failover.
//
// What the old primary had committed and the new one lacks is "undone":
// the run starts the killed primary again on its own, reads its ledger and
// receipts, and stops it. An undone commit that was never acked comes back
// by redelivery. One that was acked is lost: it is missing once the fleet
// settles (every delivery ended in an ack). With a synchronous standby that
// is a failure; with an asynchronous one (--async-standby) it is the window
// the run shows: the lost events are named, then re-sent, as a producer
// that learns of the failover re-sends, with the payments' outbox rows of
// lost receipts replayed, and the verdict requires that exactly the lost
// events were applied by it, once.

// failoverState is what the run's failovers undid.
type failoverState struct {
	pair  *sandbox.Pair
	async bool
	count int
	// undone: payments a failover undid; undoneReceipts: payments whose
	// receipt row a failover undid.
	undone, undoneReceipts map[string]bool
	// answered: undone payments whose done marker was in Redis when their
	// primary died: their COMMIT had been answered success, so they were
	// acked, or about to be, whatever the fleet did with them after.
	answered map[string]bool
	records  []FailoverRecord
}

// FailoverRecord is one failover as it happened.
type FailoverRecord struct {
	At             float64 `json:"at"`             // seconds from the start
	CutFor         string  `json:"cutFor"`         // how long the primary lived on, its standby cut off
	Undone         int     `json:"undone"`         // payments the old primary had and the new one lacked
	UndoneReceipts int     `json:"undoneReceipts"` // receipts, likewise
	Answered       int     `json:"answered"`       // undone payments whose commit had been answered success
	MarkersRead    bool    `json:"markersRead"`    // Redis was read for them when the primary died
}

// FailoverReport is the verdict's failover part.
type FailoverReport struct {
	Standby   string           `json:"standby"` // synchronous or asynchronous
	Failovers []FailoverRecord `json:"failovers"`
	// Undone counts the payments (receipts) some failover undid, whether
	// acked or not.
	Undone         int `json:"undone"`
	UndoneReceipts int `json:"undoneReceipts"`
	// Lost are the payments acked and lost: undone and missing once the
	// fleet settled. LostReceipts: payments whose receipt was, likewise.
	Lost         []string `json:"lost"`
	LostReceipts []string `json:"lostReceipts"`
	// Answered are the undone payments whose commit had been answered
	// success (their done marker was in Redis when the primary died):
	// acked, even if a later copy applied them again before the fleet
	// settled, which would hide them from Lost.
	Answered []string `json:"answered"`
	// Unnamed are missing payments no failover undid: lost otherwise.
	Unnamed []string `json:"unnamed"`
	// ReSent is the messages the re-send published (every undone payment
	// once), Replayed the outbox rows it set back to pending (the undone
	// receipts' payments'), ReApplied the payments it applied and
	// ReRecorded the payments whose receipt it recorded.
	ReSent     int      `json:"reSent"`
	Replayed   int64    `json:"replayed"`
	ReApplied  []string `json:"reApplied"`
	ReRecorded []string `json:"reRecorded"`
	// Receiptless are the payments without a receipt before the re-send:
	// the lost receipts' and the lost payments' (but those whose receipt
	// request, published before the failover, was recorded after it).
	Receiptless []string `json:"receiptless"`
}

func (f *failoverState) standby() string {
	if f.async {
		return "asynchronous"
	}
	return "synchronous"
}

// startPair starts shard 0 of a pg-failover run.
func (r *run) startPair() (*sandbox.Pair, error) {
	pair, err := sandbox.StartPair("", sandbox.PairConfig{Synchronous: !r.o.AsyncStandby})
	if err != nil {
		return nil, fmt.Errorf("chaos: pg-failover needs a primary and a standby of the run's own: %w", err)
	}
	r.fo = &failoverState{pair: pair, async: r.o.AsyncStandby, undone: map[string]bool{}, undoneReceipts: map[string]bool{}, answered: map[string]bool{}}
	return pair, nil
}

// failover is a pg-failover fault.
func (r *run) failover(ctx context.Context, p Planned) (string, error) {
	f := r.fo
	pair := f.pair
	at := r.since()
	if err := pair.CutReplication(); err != nil {
		return "", err
	}
	cut := time.Now()
	// What the primary had when the standby was cut off: a payment not in
	// it was committed after, and the standby lacks it.
	var before commits
	if f.async {
		var err error
		if before, err = readCommits(ctx, pair.Primary.URL(), false); err != nil {
			return "", err
		}
	}
	select {
	case <-ctx.Done():
	case <-time.After(p.For):
	}
	if f.async {
		// The window must be real: the primary lives on until it has
		// committed what its standby will lack, and answered at least one
		// of those commits success (its done marker is in Redis), as an
		// asynchronous primary does when it dies mid-stream (the fleet may
		// be starting, idle between bursts, or slow to mark on a busy
		// machine), for up to asyncWindowMax more, while the stream lasts.
		for deadline := time.Now().Add(asyncWindowMax); ctx.Err() == nil && time.Now().Before(deadline) && !r.published.Load(); time.Sleep(50 * time.Millisecond) {
			if r.windowReal(ctx, pair.Primary.URL(), before) {
				break
			}
		}
	}
	lived := time.Since(cut)
	if err := pair.KillPrimary(); err != nil {
		return "", err
	}
	// The done markers now in Redis name commits that were answered
	// success before the primary died; the fleet cannot write more for
	// the old primary, nor rewrite these, until the links are re-pointed.
	marked, markedErr := r.doneMarkers(ctx)
	if markedErr != nil {
		r.logf("pg-failover: the done markers could not be read (%v): answered commits are judged by what is missing only", markedErr)
	}
	if err := pair.Promote(); err != nil {
		return "", err
	}
	// What the promoted standby has, before the fleet reaches it.
	now, err := readCommits(ctx, pair.Primary.URL(), r.o.TwoHop)
	if err != nil {
		return "", fmt.Errorf("read the promoted standby: %w", err)
	}
	if err := pair.Repoint(); err != nil {
		return "", err
	}
	r.pgs[0] = pair.Primary // pg-restart's target from now on
	began := time.Now()
	if err := pair.AddStandby(); err != nil {
		return "", err
	}
	standbyIn := time.Since(began)
	former := pair.Former()
	if err := former.Recover(); err != nil {
		return "", fmt.Errorf("start the killed primary to read it: %w", err)
	}
	had, err := readCommits(ctx, former.URL(), r.o.TwoHop)
	former.Remove() // read: its files are of no more use
	if err != nil {
		return "", fmt.Errorf("read the killed primary: %w", err)
	}
	rec := FailoverRecord{At: at, CutFor: lived.Round(time.Millisecond).String(), MarkersRead: markedErr == nil}
	for id := range had.payments {
		if !now.payments[id] {
			f.undone[id] = true
			rec.Undone++
			if marked[id] {
				f.answered[id] = true
				rec.Answered++
			}
		}
	}
	for id := range had.receipts {
		if !now.receipts[id] {
			f.undoneReceipts[id] = true
			rec.UndoneReceipts++
		}
	}
	f.count++
	f.records = append(f.records, rec)
	return fmt.Sprintf("standby cut off, %s primary killed %s later, standby promoted, links re-pointed, new standby streaming %s later; the old primary had %s and %s the new one lacked",
		f.standby(), lived.Round(time.Millisecond), standbyIn.Round(100*time.Millisecond), count(rec.Undone, "payment"), count(rec.UndoneReceipts, "receipt")), nil
}

// An asynchronous primary cut off from its standby lives on until it has
// committed asyncWindowRows ledger rows since the cut and answered one of
// them success, for up to asyncWindowMax past the fault's duration, unless
// the stream was all published.
const (
	asyncWindowRows = 10
	asyncWindowMax  = 10 * time.Second
)

// windowReal reports whether the primary at url has committed
// asyncWindowRows payments since before, and, with Redis, answered one of
// them success (its done marker is there).
func (r *run) windowReal(ctx context.Context, url string, before commits) bool {
	now, err := readCommits(ctx, url, false)
	if err != nil {
		return false
	}
	var since []string
	for id := range now.payments {
		if !before.payments[id] {
			since = append(since, id)
		}
	}
	if len(since) < asyncWindowRows {
		return false
	}
	if r.redis == nil {
		return true
	}
	marked, err := r.doneMarkers(ctx)
	if err != nil {
		return false
	}
	return slices.ContainsFunc(since, func(id string) bool { return marked[id] })
}

// commits are the payments in a database's ledger and the payments its
// receipts are for.
type commits struct{ payments, receipts map[string]bool }

// readCommits reads them at url, directly.
func readCommits(ctx context.Context, url string, receipts bool) (commits, error) {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	c := commits{payments: map[string]bool{}, receipts: map[string]bool{}}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return c, err
	}
	defer conn.Close(ctx)
	read := func(sql string, into map[string]bool) error {
		rows, err := conn.Query(ctx, sql)
		if err != nil {
			return err
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		for _, id := range ids {
			into[id] = true
		}
		return err
	}
	if err := read(`SELECT event_id FROM payments_ledger`, c.payments); err != nil {
		return c, err
	}
	if receipts {
		if err := read(`SELECT payment_id FROM receipts`, c.receipts); err != nil {
			return c, err
		}
	}
	return c, nil
}

// forgiven is what the fleet may lack when it settles before the re-send:
// what the failovers undid. Nil without a failover.
func (r *run) forgiven() map[string]bool {
	if r.fo == nil || r.fo.count == 0 {
		return nil
	}
	out := maps.Clone(r.fo.undone)
	maps.Copy(out, r.fo.undoneReceipts)
	return out
}

// missingPayments are the manifest's events with no ledger row on any
// shard.
func (r *run) missingPayments(ctx context.Context, m loadgen.Manifest) ([]string, error) {
	have := map[string]bool{}
	for _, pool := range r.pools {
		if err := readIDs(ctx, pool, `SELECT event_id FROM payments_ledger`, have); err != nil {
			return nil, err
		}
	}
	var out []string
	for _, ev := range m.Events {
		if !have[ev.EventID] {
			out = append(out, ev.EventID)
		}
	}
	return out, nil
}

func readIDs(ctx context.Context, pool *pgxpool.Pool, sql string, into map[string]bool) error {
	rows, err := pool.Query(ctx, sql)
	if err != nil {
		return err
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	for _, id := range ids {
		into[id] = true
	}
	return err
}

// resend runs once the fleet settled after a run with failovers: it names
// what they lost (undone and missing) and what is missing otherwise, then
// re-sends every undone payment and replays the payments' outbox rows of
// every undone receipt, waits for the fleet to settle again, and records
// what the re-send applied.
func (r *run) resend(ctx context.Context, m loadgen.Manifest) (*FailoverReport, error) {
	f := r.fo
	rep := &FailoverReport{Standby: f.standby(), Failovers: f.records, Undone: len(f.undone), UndoneReceipts: len(f.undoneReceipts)}
	if f.count == 0 {
		return rep, nil
	}
	missing, err := r.missingPayments(ctx, m)
	if err != nil {
		return nil, err
	}
	isMissing := map[string]bool{}
	for _, id := range missing {
		isMissing[id] = true
		if f.undone[id] {
			rep.Lost = append(rep.Lost, id)
		} else {
			rep.Unnamed = append(rep.Unnamed, id)
		}
	}
	receiptsBefore := map[string]bool{}
	if r.o.TwoHop {
		for _, pool := range r.pools {
			if err := readIDs(ctx, pool, `SELECT payment_id FROM receipts`, receiptsBefore); err != nil {
				return nil, err
			}
		}
		for id := range f.undoneReceipts {
			if !receiptsBefore[id] && !isMissing[id] {
				rep.LostReceipts = append(rep.LostReceipts, id)
			}
		}
		sort.Strings(rep.LostReceipts)
		for _, ev := range m.Events {
			if !receiptsBefore[ev.EventID] {
				rep.Receiptless = append(rep.Receiptless, ev.EventID)
			}
		}
		sort.Strings(rep.Receiptless)
	}
	for id := range f.answered {
		rep.Answered = append(rep.Answered, id)
	}
	sort.Strings(rep.Answered)
	sort.Strings(rep.Lost)
	sort.Strings(rep.Unnamed)
	r.logf("failovers (%s standby): %d payments and %d receipts undone; %d payments and %d receipts acked and lost, %d payments missing otherwise",
		f.standby(), len(f.undone), len(f.undoneReceipts), len(rep.Lost), len(rep.LostReceipts), len(rep.Unnamed))
	if len(rep.Lost) > 0 {
		r.logf("lost payments: %s", names(rep.Lost))
	}
	if len(rep.LostReceipts) > 0 {
		r.logf("lost receipts (of payments): %s", names(rep.LostReceipts))
	}

	// The producer's re-send: every payment a failover undid, acked or
	// not, so that those not lost are duplicates to drop.
	var s loadgen.Stream
	for _, ev := range m.Events {
		if f.undone[ev.EventID] {
			s.Order = append(s.Order, len(s.Events))
			s.Events = append(s.Events, ev.Event)
		}
	}
	if len(s.Events) > 0 {
		t := broker.TopologyFor(r.queue, 0)
		t.Partitions = max(1, r.o.Partitions)
		if err := loadgen.Publish(ctx, loadgen.PublishOptions{URL: r.publishURL(), Topology: t, ConnectionName: "chaos-" + r.id + "-resend"}, s); err != nil {
			return nil, fmt.Errorf("chaos: re-send: %w", err)
		}
		rep.ReSent = len(s.Events)
	}
	// The receipts' producer is the payments' outbox: its rows of the
	// undone receipts, sent already, are sent again, as a replay does.
	if len(f.undoneReceipts) > 0 {
		ids := slices.Sorted(maps.Keys(f.undoneReceipts))
		for _, pool := range r.pools {
			tag, err := pool.Exec(ctx, `UPDATE idem_outbox SET state = 'pending', next_at = '-infinity', attempts = 0, sent_at = NULL
				WHERE scope = $1 AND event_id = ANY($2) AND destination = 'receipts' AND state = 'sent'`, paymentsScope, ids)
			if err != nil {
				return nil, fmt.Errorf("chaos: replay the outbox: %w", err)
			}
			rep.Replayed += tag.RowsAffected()
		}
	}
	r.logf("re-sent %d payments, replayed %d outbox rows; waiting for the fleet to settle", rep.ReSent, rep.Replayed)
	if err := r.settle(ctx, m, nil); err != nil {
		return nil, err
	}
	after, err := r.missingPayments(ctx, m)
	if err != nil {
		return nil, err
	}
	still := map[string]bool{}
	for _, id := range after {
		still[id] = true
	}
	for _, id := range missing {
		if !still[id] {
			rep.ReApplied = append(rep.ReApplied, id)
		}
	}
	sort.Strings(rep.ReApplied)
	if r.o.TwoHop {
		receiptsAfter := map[string]bool{}
		for _, pool := range r.pools {
			if err := readIDs(ctx, pool, `SELECT payment_id FROM receipts`, receiptsAfter); err != nil {
				return nil, err
			}
		}
		for id := range receiptsAfter {
			if !receiptsBefore[id] {
				rep.ReRecorded = append(rep.ReRecorded, id)
			}
		}
		sort.Strings(rep.ReRecorded)
	}
	return rep, nil
}

// count is "n thing" or "n things".
func count(n int, thing string) string {
	if n == 1 {
		return "1 " + thing
	}
	return fmt.Sprintf("%d %ss", n, thing)
}

// names lists ids, the first 20 of them.
func names(ids []string) string {
	if len(ids) <= 20 {
		return strings.Join(ids, ", ")
	}
	return strings.Join(ids[:20], ", ") + fmt.Sprintf(" and %d more", len(ids)-20)
}

// judgeFailover adds the failovers' problems: with a synchronous standby,
// anything acked and lost; with either, a missing payment no failover
// undid, or a re-send that applied other than exactly the lost payments or
// recorded other than exactly the receipts missing before it.
func (res *Result) judgeFailover(add func(cond bool, format string, args ...any)) {
	f := res.Failover
	if f == nil {
		return
	}
	sync := f.Standby == "synchronous"
	add(sync && len(f.Lost) > 0, "%d acked payments lost in a failover to a synchronous standby: %s", len(f.Lost), names(f.Lost))
	add(sync && len(f.Answered) > 0, "%d payments whose commit had been answered success undone by a failover to a synchronous standby: %s", len(f.Answered), names(f.Answered))
	add(sync && len(f.LostReceipts) > 0, "%d acked receipts lost in a failover to a synchronous standby: %s", len(f.LostReceipts), names(f.LostReceipts))
	add(len(f.Unnamed) > 0, "%d payments missing that no failover undid: %s", len(f.Unnamed), names(f.Unnamed))
	lost := slices.Concat(f.Lost, f.Unnamed)
	sort.Strings(lost)
	add(!slices.Equal(lost, f.ReApplied), "the re-send applied %d payments, not the %d lost", len(f.ReApplied), len(lost))
	add(res.Hop != nil && !slices.Equal(f.Receiptless, f.ReRecorded), "the re-send recorded %d receipts, not the %d missing", len(f.ReRecorded), len(f.Receiptless))
}

// printFailover adds the failovers' rows to the verdict table.
func (res *Result) printFailover(t *table) {
	f := res.Failover
	if f == nil {
		return
	}
	t.head(fmt.Sprintf("POSTGRES FAILOVER (%s standby)", f.Standby))
	t.row("failovers", len(f.Failovers))
	t.row("commits undone (the old primary had them, the new one not)", fmt.Sprintf("%d payments, %d receipts", f.Undone, f.UndoneReceipts))
	t.row("  of them answered success (done marker written)", len(f.Answered))
	t.row("  of them acked and lost", fmt.Sprintf("%d payments, %d receipts", len(f.Lost), len(f.LostReceipts)))
	t.row("payments missing that no failover undid", len(f.Unnamed))
	t.row("re-sent payments / replayed outbox rows", fmt.Sprintf("%d / %d", f.ReSent, f.Replayed))
	t.row("applied by the re-send (once each)", len(f.ReApplied))
	if res.Hop != nil {
		t.row("receipts missing before the re-send / recorded by it", fmt.Sprintf("%d / %d", len(f.Receiptless), len(f.ReRecorded)))
	}
}

// doneMarkers returns the payments whose done marker is in the run's
// Redis now, read with SCAN and MGET; nil, and no error, in a --cluster
// run, whose Redis it does not read.
func (r *run) doneMarkers(ctx context.Context) (map[string]bool, error) {
	if r.redis == nil {
		return nil, nil
	}
	opt, err := redis.ParseURL(r.redis.URL())
	if err != nil {
		return nil, err
	}
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out := map[string]bool{}
	iter := rdb.Scan(ctx, 0, "*:"+paymentsScope+":*", 1000).Iterator()
	var keys []string
	flush := func() error {
		if len(keys) == 0 {
			return nil
		}
		vals, err := rdb.MGet(ctx, keys...).Result()
		if err != nil {
			return err
		}
		for i, v := range vals {
			if s, ok := v.(string); ok && strings.HasPrefix(s, "done:") {
				// prefix:scope:id; neither prefix nor scope holds a ':'
				if parts := strings.SplitN(keys[i], ":", 3); len(parts) == 3 {
					out[parts[2]] = true
				}
			}
		}
		keys = keys[:0]
		return nil
	}
	for iter.Next(ctx) {
		if keys = append(keys, iter.Val()); len(keys) == 1000 {
			if err := flush(); err != nil {
				return nil, err
			}
		}
	}
	if err := iter.Err(); err != nil {
		return nil, err
	}
	return out, flush()
}
