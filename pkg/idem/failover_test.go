package idem_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/redistier"
	"github.com/idemhq/idem/pkg/idem"
)

// The stream of the failover and restore tests: streamEvents events, one
// every streamPace (about three seconds in all); the mid-stream fault lands
// once streamMid of them were acked.
const (
	streamEvents = 300
	streamPace   = 10 * time.Millisecond
	streamMid    = 100
	// streamLatency slows the standby's replication, each way: an
	// asynchronous standby trails the primary by at least that.
	streamLatency = 50 * time.Millisecond
	// streamHandlerTimeout bounds each batch, and so a commit that waits
	// for a synchronous standby.
	streamHandlerTimeout = 3 * time.Second
)

// TestAFailoverToASynchronousStandbyLosesNothing: a fleet of two consumers
// streams through a front address to a primary whose synchronous standby
// replicates slowly. Mid-stream the standby is cut off, the primary dies
// half a second later, the standby is promoted and the front address moves
// to it; the fleet reconnects. Every event the fleet acked is on the new
// primary, and every event is applied exactly once, without a re-send.
// Before the failover, /readyz and the metrics say the standby is
// synchronous.
func TestAFailoverToASynchronousStandbyLosesNothing(t *testing.T) {
	t.Parallel()
	r := newFailoverRig(t, true)
	r.requireReplication(t, "replication: ok: 1 standby, 1 synchronous ("+sandbox.StandbyName+")", 1)
	r.stream(t, func() {
		require.NoError(t, r.pair.CutReplication())
		time.Sleep(500 * time.Millisecond) // the primary lives on, cut off
		r.failover(t)
	})
	lost := r.verdict(t, "failover")
	require.Empty(t, lost, "acked events lost with a synchronous standby")
	r.requireExactlyOnce(t)
}

// TestASynchronousStandbyStalledPastTheHandlerTimeoutLosesNothing: the
// synchronous standby is cut off and the primary lives on for three
// handler timeouts before it dies. A commit waiting for the standby that
// its client gives up on (the handler's deadline cancels it) is not
// replicated, yet PostgreSQL ends the wait and keeps the commit, visible to
// every later transaction. The redelivery of its event must not be acked
// as a duplicate on the strength of that row: nothing acked may be lost by
// the failover that follows.
func TestASynchronousStandbyStalledPastTheHandlerTimeoutLosesNothing(t *testing.T) {
	t.Parallel()
	r := newFailoverRig(t, true)
	r.stream(t, func() {
		require.NoError(t, r.pair.CutReplication())
		cut := r.acks.count()
		stalled := time.Now()
		for time.Since(stalled) < 3*streamHandlerTimeout && r.acks.count() < cut+10 {
			time.Sleep(50 * time.Millisecond) // the primary lives on, cut off
		}
		t.Logf("%d events acked while the synchronous standby was cut off", r.acks.count()-cut)
		r.failover(t)
	})
	lost := r.verdict(t, "failover")
	require.Empty(t, lost, "acked events lost with a synchronous standby")
	r.requireExactlyOnce(t)
}

// TestAFailoverToAnAsynchronousStandbyLosesOnlyWhatTheReSendApplies: the
// same, with an asynchronous standby, and the primary lives on after the
// cut until ten more events were acked. Those, and whatever else the
// standby had not received, are lost: the test names them (it knows what
// the fleet acked), and nothing else is missing or doubled. The producer
// then re-sends the whole stream while the lost events' done markers still
// live in Redis: the re-send applies exactly the lost events, once, and the
// others are duplicates. Before the failover, /readyz and the metrics warn.
func TestAFailoverToAnAsynchronousStandbyLosesOnlyWhatTheReSendApplies(t *testing.T) {
	t.Parallel()
	r := newFailoverRig(t, false)
	r.requireReplication(t, "replication: failing (not required): 1 standby, none synchronous (synchronous_standby_names is empty): an acked event can be lost on failover", 0)
	r.stream(t, func() {
		require.NoError(t, r.pair.CutReplication())
		cut := r.acks.count()
		require.Eventually(t, func() bool { return r.acks.count() >= cut+10 }, 20*time.Second, 5*time.Millisecond,
			"the primary acks on, cut off from its standby")
		r.failover(t)
	})
	lost := r.verdict(t, "failover")
	require.NotEmpty(t, lost, "the premise: events acked after the cut are lost")
	r.resend(t, lost)
}

// TestABaseBackupRestoredMidStreamLosesOnlyWhatTheReSendApplies: a base
// backup of the fleet's database is taken mid-stream; more events are
// acked; the database dies and the backup is restored in its place (the
// same address and cluster, on a new timeline, without the commits after
// the backup); the fleet reconnects. The events acked after the backup are
// lost and named; the re-send of the whole stream applies exactly those,
// once.
func TestABaseBackupRestoredMidStreamLosesOnlyWhatTheReSendApplies(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	db, dbURL := testenv.SchemaOn(t, pg.URL(), testenv.Effects)
	r := newStreamRig(t, db, dbURL)
	r.stream(t, func() {
		var backup *sandbox.Postgres
		r.paused(func() {
			var err error
			backup, err = pg.BaseBackup()
			require.NoError(t, err)
		})
		t.Cleanup(backup.Remove)
		taken := r.acks.count()
		require.Eventually(t, func() bool { return r.acks.count() >= taken+30 }, 30*time.Second, 5*time.Millisecond,
			"events acked after the backup")
		pg.Stop()
		backup.Port = pg.Port
		require.NoError(t, backup.Start())
	})
	lost := r.verdict(t, "restore of a base backup")
	require.NotEmpty(t, lost, "the premise: events acked after the backup are lost")
	r.resend(t, lost)
}

// TestADumpRestoredMidStreamLosesOnlyWhatTheReSendApplies: a pg_dump of
// the fleet's database is taken mid-stream; more events are acked; the
// fleet is cut off from the database, which is dropped, re-created in the
// same cluster and restored from the dump; the fleet reconnects. The events
// acked after the dump are lost and named; the re-send of the whole stream
// applies exactly those, once.
func TestADumpRestoredMidStreamLosesOnlyWhatTheReSendApplies(t *testing.T) {
	t.Parallel()
	direct, recreate := testenv.Database(t)
	link := faultLink(t, "postgres", direct)
	db, dbURL := testenv.SchemaOn(t, viaLink(t, direct, link), testenv.Effects)
	r := newStreamRig(t, db, dbURL)
	r.stream(t, func() {
		dump := filepath.Join(t.TempDir(), "dump")
		r.paused(func() { testenv.RunPostgresTool(t, "pg_dump", "-Fc", "-f", dump, "-d", direct) })
		taken := r.acks.count()
		require.Eventually(t, func() bool { return r.acks.count() >= taken+30 }, 30*time.Second, 5*time.Millisecond,
			"events acked after the dump")
		require.NoError(t, link.Reset())
		recreate()
		testenv.RunPostgresTool(t, "pg_restore", "-d", direct, dump)
		require.NoError(t, link.Heal())
	})
	lost := r.verdict(t, "restore of a dump")
	require.NotEmpty(t, lost, "the premise: events acked after the dump are lost")
	r.resend(t, lost)
}

// failoverRig is a streamRig on a primary and its standby, through the
// pair's front link.
type failoverRig struct {
	*streamRig
	pair *sandbox.Pair
}

func newFailoverRig(t *testing.T, synchronous bool) *failoverRig {
	pair := testenv.StartPair(t, sandbox.PairConfig{Synchronous: synchronous, ReplicationLatency: streamLatency})
	db, dbURL := testenv.SchemaOn(t, pair.URL(), testenv.Effects)
	return &failoverRig{streamRig: newStreamRig(t, db, dbURL), pair: pair}
}

// failover kills the primary (its standby already cut off), promotes the
// standby and moves the front link to it.
func (r *failoverRig) failover(t *testing.T) {
	t.Helper()
	for _, step := range []func() error{r.pair.KillPrimary, r.pair.Promote, r.pair.Repoint} {
		require.NoError(t, step())
	}
}

// requireReplication checks what the fleet's first service says of its
// database's standbys: its /readyz line, and idem_postgres_sync_standbys.
func (r *failoverRig) requireReplication(t *testing.T, line string, syncStandbys int) {
	t.Helper()
	var body string
	require.Eventually(t, func() bool {
		rec := httptest.NewRecorder()
		r.svcs[0].Health().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
		body = rec.Body.String()
		return strings.Contains(body, line)
	}, 10*time.Second, 20*time.Millisecond, "/readyz says %q", line)
	families, err := r.metrics.Gather()
	require.NoError(t, err)
	for _, f := range families {
		if f.GetName() == "idem_postgres_sync_standbys" {
			require.Equal(t, float64(syncStandbys), f.GetMetric()[0].GetGauge().GetValue())
			return
		}
	}
	t.Fatal("no idem_postgres_sync_standbys")
}

// streamRig is a fleet of two services with Redis on, streaming one
// queue's events into one database, and what they acked.
type streamRig struct {
	amqpURL, queue string
	db             *pgxpool.Pool // the verdicts read the ledger through it
	svcs           []*idem.Service[string]
	metrics        *prometheus.Registry
	acks           *ackLog
	publish        func(ids ...string)
	ids            []string
	gate           sync.Mutex // held, the stream publishes nothing
}

func newStreamRig(t *testing.T, db *pgxpool.Pool, dbURL string) *streamRig {
	t.Helper()
	r := &streamRig{amqpURL: testenv.AMQPURL(), db: db, acks: &ackLog{acked: map[string]guard.Outcome{}}}
	r.queue = testenv.Queue(t, r.amqpURL)
	_, prefix := testenv.Redis(t)
	r.metrics = prometheus.NewRegistry()
	for i := range 2 {
		cfg := idem.Config{Scope: "pay", DatabaseURL: dbURL, RedisURL: testenv.RedisURL(),
			Fast:     redistier.Config{Prefix: prefix},
			Consumer: consumer.Config{URL: r.amqpURL, Queue: r.queue, HandlerTimeout: streamHandlerTimeout, Observer: r.acks}}
		if i == 0 {
			cfg.Metrics = r.metrics
		}
		svc, _ := runService(t, cfg, ledgerHandler{})
		r.svcs = append(r.svcs, svc)
	}
	require.Eventually(t, func() bool { return r.svcs[0].Stats().Consuming && r.svcs[1].Stats().Consuming },
		30*time.Second, 20*time.Millisecond, "the fleet consumes")
	r.publish = publisher(t, r.amqpURL, r.queue)
	for i := range streamEvents {
		r.ids = append(r.ids, fmt.Sprintf("e%04d", i))
	}
	return r
}

// stream publishes the stream, one event every streamPace, runs fault
// once streamMid events were acked, and waits until the whole stream was
// published and the fleet has settled every delivery.
func (r *streamRig) stream(t *testing.T, fault func()) {
	t.Helper()
	published := make(chan error, 1)
	go func() { published <- publishPaced(r.amqpURL, r.queue, r.ids, &r.gate) }()
	require.Eventually(t, func() bool { return r.acks.count() >= streamMid }, 30*time.Second, 5*time.Millisecond,
		"%d events acked before the fault", streamMid)
	began := time.Now()
	fault()
	t.Logf("the fault took %s; %d events acked so far", time.Since(began).Round(time.Millisecond), r.acks.count())
	require.NoError(t, <-published)
	r.settle(t)
}

// paused runs slow with the stream's publishing held, so that however long
// slow takes on a loaded machine, events are left to publish after it.
func (r *streamRig) paused(slow func()) {
	r.gate.Lock()
	defer r.gate.Unlock()
	slow()
}

// publishPaced publishes one message per id to queue, one every
// streamPace, each confirmed by the broker, as publisher does, from any
// goroutine; it waits while gate is held.
func publishPaced(amqpURL, queue string, ids []string, gate *sync.Mutex) error {
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if err := ch.Confirm(false); err != nil {
		return err
	}
	pace := time.NewTicker(streamPace)
	defer pace.Stop()
	for _, id := range ids {
		<-pace.C
		gate.Lock()
		gate.Unlock() //nolint:staticcheck // a wait while the fault holds it
		if err := publishID(ch, queue, id); err != nil {
			return fmt.Errorf("publish %s: %w", id, err)
		}
	}
	return nil
}

// settle waits until the queue is empty and the fleet holds no delivery.
func (r *streamRig) settle(t *testing.T) {
	t.Helper()
	require.Eventually(t, func() bool {
		if testenv.QueueDepth(t, r.amqpURL, r.queue) != 0 {
			return false
		}
		for _, svc := range r.svcs {
			if st := svc.Stats(); !st.Consuming || st.Unacked > 0 {
				return false
			}
		}
		return true
	}, 90*time.Second, 50*time.Millisecond, "the fleet settles every delivery")
	require.Zero(t, testenv.QueueDepth(t, r.amqpURL, r.queue+".dlq"), "nothing dead-lettered")
}

// ledger counts the ledger's rows by event.
func (r *streamRig) ledger(t *testing.T) map[string]int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rows, err := r.db.Query(ctx, `SELECT event_id, count(*) FROM ledger GROUP BY event_id`)
	require.NoError(t, err)
	out := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		require.NoError(t, rows.Scan(&id, &n))
		out[id] = n
	}
	require.NoError(t, rows.Err())
	return out
}

// verdict checks what the database holds after what: no event applied
// twice, and every event missing one the fleet acked (its commit lost with
// the history it was made in). It returns those, sorted, and names them
// with the outcome they were first acked with.
func (r *streamRig) verdict(t *testing.T, what string) (lost []string) {
	t.Helper()
	ledger := r.ledger(t)
	acked := r.acks.snapshot()
	for _, id := range r.ids {
		switch n := ledger[id]; {
		case n > 1:
			t.Errorf("%s applied %d times", id, n)
		case n == 0:
			if _, ok := acked[id]; !ok {
				t.Errorf("%s is missing and was never acked", id)
			}
			lost = append(lost, id)
		}
	}
	sort.Strings(lost)
	named := make([]string, len(lost))
	for i, id := range lost {
		named[i] = id + " (" + acked[id].String() + ")"
	}
	t.Logf("after the %s: %d of %d events applied, %d acked and lost: %s",
		what, len(r.ids)-len(lost), len(r.ids), len(lost), strings.Join(named, ", "))
	return lost
}

// resend publishes the whole stream again, as a producer that knows a
// failover or a restore lost commits does, and checks that it applied
// exactly the lost events, once each: every event is then applied exactly
// once.
func (r *streamRig) resend(t *testing.T, lost []string) {
	t.Helper()
	before := r.ledger(t)
	r.publish(r.ids...)
	r.settle(t)
	after := r.ledger(t)
	var applied []string
	for id, n := range after {
		if n > before[id] {
			applied = append(applied, id)
		}
	}
	sort.Strings(applied)
	require.Equal(t, lost, applied, "the re-send applies exactly the lost events")
	r.requireExactlyOnce(t)
}

// requireExactlyOnce: every event of the stream has exactly one ledger row.
func (r *streamRig) requireExactlyOnce(t *testing.T) {
	t.Helper()
	ledger := r.ledger(t)
	for _, id := range r.ids {
		require.Equal(t, 1, ledger[id], "%s applied once", id)
	}
	require.Len(t, ledger, len(r.ids), "nothing but the stream applied")
}

// ackLog records the events the fleet acked (applied, or found applied),
// with the first such outcome of each.
type ackLog struct {
	mu    sync.Mutex
	acked map[string]guard.Outcome
}

var _ consumer.Observer = (*ackLog)(nil)

func (a *ackLog) Settled(_ context.Context, s consumer.Settlement) {
	if s.Outcome != guard.OutcomeProcessed && !s.Outcome.IsDuplicate() {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if _, ok := a.acked[s.EventID]; !ok {
		a.acked[s.EventID] = s.Outcome
	}
}

func (a *ackLog) Count(string, int) {}
func (a *ackLog) Gathered(int)      {}

func (a *ackLog) count() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.acked)
}

func (a *ackLog) snapshot() map[string]guard.Outcome {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make(map[string]guard.Outcome, len(a.acked))
	for id, o := range a.acked {
		out[id] = o
	}
	return out
}
