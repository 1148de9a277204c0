package roundtrip

import (
	"context"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// Cause is what a Postgres round trip was for, read from its SQL by Classify.
type Cause string

// The causes, named after the statements of the guard (pkg/guard/pgtier),
// of pgx's transactions and of the payments handler (internal/payments).
const (
	CauseBegin      Cause = "begin"       // the guard's BEGIN (with its SET LOCALs and advisory lock)
	CauseClaim      Cause = "claim"       // the claim: insert the dedup rows, read the hashes of record
	CauseHistory    Cause = "history"     // the database's history, read alone
	CauseWALMessage Cause = "wal-message" // pg_logical_emit_message, so that a claim of duplicates waits for durability
	CauseLookup     Cause = "lookup"      // a read of hashes of record after a concurrent commit
	CauseCommit     Cause = "commit"
	CauseRollback   Cause = "rollback"
	CauseApply      Cause = "apply"   // the handler's own statements
	CauseSession    Cause = "session" // SET, SHOW, RESET, set_config: a connection's set-up
	CauseOther      Cause = "other"
)

// Causes lists every Cause, in the order tables show them.
var Causes = [...]Cause{CauseBegin, CauseClaim, CauseHistory, CauseWALMessage, CauseLookup,
	CauseCommit, CauseRollback, CauseApply, CauseSession, CauseOther}

// applyTables are the tables the payments and receipts handlers write,
// the outbox included (Handler.Receipts enqueues in the payment's
// transaction).
var applyTables = []string{"payments_ledger", "account_balances", "receipts", "idem_outbox"}

// Classify says what sql is for. It goes by how the statements open, not
// by their whole text, so that a change inside a statement leaves its cause
// alone; the order of the cases matters: the guard's BEGIN holds SET LOCALs,
// and the claim and the history read name idem_processed as a lookup does.
func Classify(sql string) Cause {
	s := strings.TrimSpace(sql)
	opens := func(prefix string) bool { return len(s) >= len(prefix) && strings.EqualFold(s[:len(prefix)], prefix) }
	switch {
	case opens("BEGIN"):
		return CauseBegin
	case opens("COMMIT"):
		return CauseCommit
	case opens("ROLLBACK"):
		return CauseRollback
	case opens("WITH hist AS"):
		return CauseClaim
	case opens("SELECT left(md5(concat_ws("):
		return CauseHistory
	case strings.Contains(s, "pg_logical_emit_message"):
		return CauseWALMessage
	case opens("SET ") || opens("SHOW ") || opens("RESET ") || strings.Contains(s, "set_config("):
		return CauseSession
	case opens("INSERT INTO ") && hasAny(s, applyTables):
		return CauseApply
	case opens("SELECT ") && strings.Contains(s, "idem_processed"):
		return CauseLookup
	}
	return CauseOther
}

func hasAny(s string, words []string) bool {
	for _, w := range words {
		if strings.Contains(s, w) {
			return true
		}
	}
	return false
}

// Cost is the round trips of one cause and the time spent in them.
type Cost struct {
	Trips int64 `json:"trips"`
	// WaitMicros is the sum, over the trips, of the time from the
	// statement's start to its end as pgx traces them (for a query, until
	// its rows are closed), in microseconds. Trips on different
	// connections overlap, so this is connection time, not wall time.
	WaitMicros int64 `json:"waitMicros"`
}

// ByCause counts Postgres round trips and their time by Cause. It is safe
// for concurrent use; the zero value is ready.
type ByCause struct {
	costs [len(Causes)]struct{ trips, nanos atomic.Int64 } // by index in Causes
}

func indexOf(c Cause) int {
	for i, k := range Causes {
		if k == c {
			return i
		}
	}
	return len(Causes) - 1 // other
}

// Tracer returns a pgx tracer that records into b: one trip per statement
// (BEGIN and COMMIT included) and per batch, which pgx sends in one round
// trip and which is classified by its first statement.
func (b *ByCause) Tracer() pgx.QueryTracer { return causeTracer{b} }

// Total is the round trips of every cause.
func (b *ByCause) Total() int64 {
	var n int64
	for i := range b.costs {
		n += b.costs[i].trips.Load()
	}
	return n
}

// Snapshot returns the cost of each cause that had a trip.
func (b *ByCause) Snapshot() map[Cause]Cost {
	out := map[Cause]Cost{}
	for i, c := range Causes {
		if n := b.costs[i].trips.Load(); n > 0 {
			out[c] = Cost{Trips: n, WaitMicros: b.costs[i].nanos.Load() / 1000}
		}
	}
	return out
}

type causeTracer struct{ b *ByCause }

var _ pgx.BatchTracer = causeTracer{}

// started is what TraceQueryStart hands TraceQueryEnd through the context.
type started struct {
	i  int
	at time.Time
}

type startedKey struct{}

// start counts the trip at once, so that the stats a worker writes while
// statements are in flight include them, and stamps the context.
func (t causeTracer) start(ctx context.Context, sql string) context.Context {
	i := indexOf(Classify(sql))
	t.b.costs[i].trips.Add(1)
	return context.WithValue(ctx, startedKey{}, started{i: i, at: time.Now()})
}

func (t causeTracer) end(ctx context.Context) {
	if s, ok := ctx.Value(startedKey{}).(started); ok {
		t.b.costs[s.i].nanos.Add(int64(time.Since(s.at)))
	}
}

func (t causeTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	return t.start(ctx, d.SQL)
}

func (t causeTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	t.end(ctx)
}

func (t causeTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	var sql string
	if d.Batch != nil && len(d.Batch.QueuedQueries) > 0 {
		sql = d.Batch.QueuedQueries[0].SQL
	}
	return t.start(ctx, sql)
}

func (causeTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (t causeTracer) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchEndData) {
	t.end(ctx)
}
