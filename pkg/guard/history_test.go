package guard_test

import (
	"context"
	"encoding/hex"
	"errors"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/fastkey"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/guard/redistier"
)

// otherHistory is a history no store reports in these tests.
const otherHistory = "aaaaaaaaaaaa"

func (f *fixture) marker(t *testing.T, id string) string {
	t.Helper()
	v, err := f.redis.Get(fastkey.Key("idem", "payments", id))
	require.NoError(t, err)
	return v
}

func (f *fixture) history(t *testing.T) string {
	t.Helper()
	h, err := pgtier.New(f.pool).History(context.Background())
	require.NoError(t, err)
	return string(h)
}

// TestDoneMarkerNamesTheStoresHistory: the marker written after the commit
// is done:<history>:<hash>, with the history the store reported in the
// committing transaction.
func TestDoneMarkerNamesTheStoresHistory(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ev := event("evt_1", 1)
	require.Equal(t, guard.OutcomeProcessed, f.process(t, ev))
	h := f.history(t)
	require.Regexp(t, `^[0-9a-f]{12}$`, h)
	require.Equal(t, "done:"+h+":"+hex.EncodeToString(ev.Hash), f.marker(t, ev.ID))
}

// TestAMarkerOfAnotherHistoryIsAbsent: a done marker that names another
// history than the store's, or none (written by an earlier version), drops
// nothing: the store decides, and the marker is written again in the
// store's history, so the next duplicate is cheap again.
func TestAMarkerOfAnotherHistoryIsAbsent(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name      string
		processed bool   // the store holds the event's row
		marker    string // the marker's value, from the hex hash
		want      guard.Outcome
	}{
		{"another history, row lost", false, "done:" + otherHistory + ":", guard.OutcomeProcessed},
		{"another history, row kept", true, "done:" + otherHistory + ":", guard.OutcomeDuplicatePostgres},
		{"an earlier version's marker, row lost", false, "done:", guard.OutcomeProcessed},
		{"an earlier version's marker, row kept", true, "done:", guard.OutcomeDuplicatePostgres},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			f := newFixture(t)
			ev := event("evt_1", 1)
			if c.processed {
				require.Equal(t, guard.OutcomeProcessed, f.process(t, ev))
			}
			require.NoError(t, f.redis.Set(fastkey.Key("idem", "payments", ev.ID), c.marker+hex.EncodeToString(ev.Hash)))
			require.Equal(t, c.want, f.process(t, ev))
			require.Equal(t, 1, f.ledgerRows(t, ev.ID))
			require.Equal(t, "done:"+f.history(t)+":"+hex.EncodeToString(ev.Hash), f.marker(t, ev.ID), "rewritten in the store's history")
			require.Equal(t, guard.OutcomeDuplicateRedis, f.process(t, ev))
		})
	}
}

// TestAHistoryChangeNeedsNoErrorToBeSeen: the store's rows go back to before
// an event (here its dedup table truncated and its effect deleted, as a
// restore of both would) while the guard's connections stay open and no
// call fails. The re-sent event is applied once again, not dropped on the
// marker written before: every batch that would drop an event on a marker
// reads the store's history after it read the marker.
func TestAHistoryChangeNeedsNoErrorToBeSeen(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ev := event("evt_1", 1)
	require.Equal(t, guard.OutcomeProcessed, f.process(t, ev))
	require.Equal(t, guard.OutcomeDuplicateRedis, f.process(t, ev))
	before := f.history(t)
	_, err := f.pool.Exec(context.Background(), `TRUNCATE idem_processed; DELETE FROM ledger`)
	require.NoError(t, err)
	require.NotEqual(t, before, f.history(t))
	require.Equal(t, guard.OutcomeProcessed, f.process(t, ev))
	require.Equal(t, 1, f.ledgerRows(t, ev.ID))
	require.Equal(t, guard.OutcomeDuplicateRedis, f.process(t, ev))
}

// TestNoConfirmationNoTrust: a guard that trusted a marker a moment ago
// does not trust it while the store cannot say which history it is in: a
// store that does not answer confirms nothing, so the event waits for the
// store (an error: the consumer holds it) rather than being dropped. Once
// the store answers with the marker's history, the marker counts again.
func TestNoConfirmationNoTrust(t *testing.T) {
	t.Parallel()
	faults := sandbox.StartFaults()
	t.Cleanup(faults.Close)
	f := newFixture(t)
	u, err := pgxpool.ParseConfig(f.url)
	require.NoError(t, err)
	link, err := faults.Link("postgres", net.JoinHostPort(u.ConnConfig.Host, strconv.Itoa(int(u.ConnConfig.Port))))
	require.NoError(t, err)
	host, port, _ := net.SplitHostPort(link.Addr())
	p, err := strconv.Atoi(port)
	require.NoError(t, err)
	u.ConnConfig.Host, u.ConnConfig.Port = host, uint16(p)
	pool, err := pgxpool.NewWithConfig(context.Background(), u)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	g, err := guard.New(guard.Config{Scope: "payments", Store: pgtier.New(pool), Fast: f.fast})
	require.NoError(t, err)

	ev := event("evt_1", 1)
	process := func() (guard.Outcome, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		o, err := g.Process(ctx, ev, pay(ev.ID))
		return o, errors.Join(err, g.Flush(ctx))
	}
	o, err := process()
	require.NoError(t, err)
	require.Equal(t, guard.OutcomeProcessed, o)
	o, err = process()
	require.NoError(t, err)
	require.Equal(t, guard.OutcomeDuplicateRedis, o)

	require.NoError(t, link.Reset())
	o, err = process()
	var se *guard.StoreError
	require.ErrorAs(t, err, &se, "a marker the store did not confirm dropped the event (%s)", o)
	require.NoError(t, link.Heal())
	require.Eventually(t, func() bool {
		o, err := process()
		return err == nil && o == guard.OutcomeDuplicateRedis
	}, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, 1, f.ledgerRows(t, ev.ID))
}

// statements counts the statements a pool sends, by their first words.
type statements struct {
	mu sync.Mutex
	n  map[string]int
}

func (s *statements) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range []string{"WITH hist AS", "SELECT left(md5"} {
		if strings.HasPrefix(d.SQL, p) {
			s.n[p]++
		}
	}
	return ctx
}
func (s *statements) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (s *statements) take() (claims, histories int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	claims, histories = s.n["WITH hist AS"], s.n["SELECT left(md5"]
	clear(s.n)
	return claims, histories
}

// TestTheHistoryRidesOnTheClaim: a batch that claims rows confirms its done
// markers with the history its claim statement returns, at no cost of its
// own; a batch of duplicates alone reads it in one small query; a marker of
// another history costs the claim made again with its event, in a new
// transaction.
func TestTheHistoryRidesOnTheClaim(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	cfg, err := pgxpool.ParseConfig(f.url)
	require.NoError(t, err)
	rec := &statements{n: map[string]int{}}
	cfg.ConnConfig.Tracer = rec
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	g, err := guard.New(guard.Config{Scope: "payments", Store: pgtier.New(pool), Fast: f.fast})
	require.NoError(t, err)
	ctx := context.Background()
	run := func(batch ...guard.Event) []guard.Outcome {
		t.Helper()
		res, err := g.ProcessBatch(ctx, batch, payAll(batch))
		require.NoError(t, err)
		require.NoError(t, g.Flush(ctx))
		return outcomes(res)
	}
	old, stale, lost := event("evt_old", 1), event("evt_stale", 1), event("evt_lost", 1)
	require.Equal(t, []guard.Outcome{guard.OutcomeProcessed, guard.OutcomeProcessed}, run(old, stale))
	rec.take()

	require.Equal(t, []guard.Outcome{guard.OutcomeDuplicateRedis, guard.OutcomeDuplicateRedis}, run(old, old))
	claims, histories := rec.take()
	require.Equal(t, [2]int{0, 1}, [2]int{claims, histories}, "duplicates alone: one small query")

	require.Equal(t, []guard.Outcome{guard.OutcomeProcessed, guard.OutcomeDuplicateRedis}, run(event("evt_new", 1), old))
	claims, histories = rec.take()
	require.Equal(t, [2]int{1, 0}, [2]int{claims, histories}, "with new events: the claim's history")

	hash := func(ev guard.Event) string { return hex.EncodeToString(ev.Hash) }
	require.NoError(t, f.redis.Set(fastkey.Key("idem", "payments", stale.ID), "done:"+otherHistory+":"+hash(stale)))
	require.NoError(t, f.redis.Set(fastkey.Key("idem", "payments", lost.ID), "done:"+otherHistory+":"+hash(lost)))
	got := run(event("evt_new2", 1), old, stale, lost, lost)
	require.Equal(t, []guard.Outcome{guard.OutcomeProcessed, guard.OutcomeDuplicateRedis, guard.OutcomeDuplicatePostgres,
		guard.OutcomeProcessed, guard.OutcomeDuplicateBatch}, got)
	claims, histories = rec.take()
	require.Equal(t, [2]int{2, 0}, [2]int{claims, histories}, "markers of another history: the claim made again")
	require.Equal(t, 1, f.ledgerRows(t, lost.ID))

	require.NoError(t, f.redis.Set(fastkey.Key("idem", "payments", stale.ID), "done:"+otherHistory+":"+hash(stale)))
	require.Equal(t, []guard.Outcome{guard.OutcomeDuplicatePostgres, guard.OutcomeDuplicateRedis}, run(stale, old))
	claims, histories = rec.take()
	require.Equal(t, [2]int{1, 1}, [2]int{claims, histories}, "duplicates alone, one of another history")
}

// TestAStoreThatCannotAnswerHoldsDuplicates: with the store away, no
// duplicate is dropped on the fast tier's word, for a failover is exactly
// when its markers are in doubt: the batch fails (the consumer holds it)
// instead, quickly when the store refuses connections.
func TestAStoreThatCannotAnswerHoldsDuplicates(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ev := event("evt_1", 1)
	require.Equal(t, guard.OutcomeProcessed, f.process(t, ev))
	down, err := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:"+strconv.Itoa(testenv.FreePort(t))+"/test?sslmode=disable&connect_timeout=2")
	require.NoError(t, err)
	t.Cleanup(down.Close)
	g, err := guard.New(guard.Config{Scope: "payments", Store: pgtier.New(down), Fast: f.fast})
	require.NoError(t, err)
	o, err := g.Process(context.Background(), ev, pay(ev.ID))
	var se *guard.StoreError
	require.ErrorAs(t, err, &se, "dropped on a marker no store confirmed (%s)", o)
}

// redisRig is a guard over pool with a fast tier on the shared Redis, under
// a key prefix of the test's own.
func redisRig(t *testing.T, pool *pgxpool.Pool) (*guard.Guard, *redis.Client, string) {
	t.Helper()
	rdb, prefix := testenv.Redis(t)
	fast, err := redistier.New(rdb, redistier.Config{Prefix: prefix, Timeout: time.Second})
	require.NoError(t, err)
	g, err := guard.New(guard.Config{Scope: "payments", Store: pgtier.New(pool), Fast: fast})
	require.NoError(t, err)
	return g, rdb, prefix
}

// processAgain runs ev through g until the store answers (a database that
// was replaced under the pool fails the calls that meet its old
// connections), and returns its outcome.
func processAgain(t *testing.T, g *guard.Guard, ev guard.Event) guard.Outcome {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		o, err := g.Process(ctx, ev, pay(ev.ID))
		if err == nil {
			require.NoError(t, g.Flush(ctx))
		}
		cancel()
		var se *guard.StoreError
		switch {
		case err == nil:
			return o
		case !errors.As(err, &se) || time.Now().After(deadline):
			t.Fatalf("process %s: %v", ev.ID, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// ledgerRowsAt counts id's ledger rows on a connection of its own, so that
// the pool's connections to a database replaced under it are left for the
// guard to meet.
func ledgerRowsAt(t *testing.T, dbURL, id string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, dbURL)
	require.NoError(t, err)
	defer c.Close(ctx)
	var n int
	require.NoError(t, c.QueryRow(ctx, `SELECT count(*) FROM ledger WHERE event_id = $1`, id).Scan(&n))
	return n
}
