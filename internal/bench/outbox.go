package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/fleet"
	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/migrations"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/outbox"
)

// OutboxOptions describe `idem-lab bench --outbox`: the relay's rows.
type OutboxOptions struct {
	Bin string // idem-lab: its relay and consume
	// BaselineBin, if set, is an idem-lab built from an earlier commit
	// whose relays also run each relay throughput row, in the same runs.
	BaselineBin string
	Dir         string
	AMQPURL     string
	DatabaseURL string
	RedisURL    string
	Messages    int           // rows each throughput run relays
	Rate        float64       // the latency rows' offered rate, messages/s
	LatencyFor  time.Duration // how long a latency run offers it
	Runs        int
	Progress    io.Writer
}

// OutboxResult is one outbox row's medians.
type OutboxResult struct {
	Row      string  `json:"row"`
	Runs     int     `json:"runs"`
	Messages int     `json:"messages"` // per run
	Rate     float64 `json:"rate"`     // relayed (or offered) messages/s
	// CPU per message, µs: the relays (or, for two hops, every consumer
	// and relay process), PostgreSQL and RabbitMQ.
	CPUProcs    float64 `json:"cpuProcsMicros"`
	CPUPostgres float64 `json:"cpuPostgresMicros"`
	CPURabbitMQ float64 `json:"cpuRabbitMQMicros"`
	// OfRaw is the median of the per-run ratios of this row's rate to
	// the raw confirming publisher's in the same run, for the relay rows
	// measured as it is (destination drained).
	OfRaw float64 `json:"ofRawPublisher,omitempty"`
	// Latencies, ms: commit to delivery (latency row), or the first hop's
	// transaction to the second hop's (two-hop row).
	P50 float64 `json:"p50ms,omitempty"`
	P99 float64 `json:"p99ms,omitempty"`
	Max float64 `json:"maxMs,omitempty"`
	// Lost and Doubled count messages never delivered or delivered with
	// an ID already delivered (latency row), or payments without or with
	// two receipts (two-hop row), over all runs.
	Lost    int `json:"lost"`
	Doubled int `json:"doubled"`
}

type outboxRun struct {
	rate              float64
	procs, pg, rabbit float64 // CPU seconds
	lat               []time.Duration
	lost, doubled     int
	messages          int
}

// RunOutbox runs the outbox rows: the relay's throughput with confirms, one
// and two relays on a prefilled outbox (and one of the baseline's, with
// BaselineBin); commit-to-delivery latency at a fixed rate; and the
// two-hop pipeline's latency at that rate. Each run goes through every row
// in turn, so that a relay row's ratio to the raw publisher is taken
// within a run.
func RunOutbox(ctx context.Context, o OutboxOptions) ([]OutboxResult, error) {
	if o.Runs < 1 || o.Messages < 1000 || o.Rate <= 0 || o.LatencyFor < time.Second {
		return nil, errors.New("bench --outbox: --runs ≥ 1, --events ≥ 1000, --rate > 0 and --latency-for ≥ 1s")
	}
	if o.Progress == nil {
		o.Progress = io.Discard
	}
	admin, err := pgxpool.New(ctx, o.DatabaseURL)
	if err != nil {
		return nil, err
	}
	defer admin.Close()
	b := &outboxBench{o: o, admin: admin}
	rows := []outboxRow{{rawPublisherRow, b.rawPublisher, false}}
	// relayRow adds a relay throughput row, and with a baseline build its
	// twin run by that build's relay, in the same runs.
	relayRow := func(name string, relays int, drain bool) {
		rows = append(rows, outboxRow{name, func(ctx context.Context, i int) (outboxRun, error) {
			return b.throughput(ctx, o.Bin, i, relays, drain)
		}, drain})
		if o.BaselineBin != "" {
			rows = append(rows, outboxRow{name + ", baseline build", func(ctx context.Context, i int) (outboxRun, error) {
				return b.throughput(ctx, o.BaselineBin, i, relays, drain)
			}, drain})
		}
	}
	relayRow("relay ×1, confirms, destination drained", 1, true)
	relayRow("relay ×2, confirms, destination drained", 2, true)
	relayRow("relay ×2, confirms, destination's consumer elsewhere", 2, false)
	rows = append(rows, []outboxRow{
		{fmt.Sprintf("commit → delivered, %.0f/s, relay ×1", o.Rate), b.latency, false},
		{fmt.Sprintf("two hops: payment tx → receipt tx, %.0f/s", o.Rate), b.twoHops, false},
	}...)
	runs := make([][]outboxRun, len(rows))
	for i := range o.Runs {
		for k, row := range rows {
			waitQuiet(10 * time.Second)
			r, err := row.run(ctx, i)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", row.name, err)
			}
			fmt.Fprintf(o.Progress, "%s, run %d: %.0f msg/s, p99 %.1f ms\n", row.name, i+1, r.rate, ms(pct(r.lat, 0.99)))
			runs[k] = append(runs[k], r)
		}
	}
	var out []OutboxResult
	for k, row := range rows {
		res := summarizeOutbox(row.name, runs[k])
		if row.ofRaw {
			ratios := make([]float64, len(runs[k]))
			for i, r := range runs[k] {
				ratios[i] = r.rate / runs[0][i].rate // rows[0] is the raw publisher
			}
			res.OfRaw = median(ratios)
		}
		out = append(out, res)
	}
	return out, nil
}

// outboxRow is one row of RunOutbox: its name, one run of it, and whether
// it is compared with the raw confirming publisher.
type outboxRow struct {
	name  string
	run   func(context.Context, int) (outboxRun, error)
	ofRaw bool
}

// rawPublisherRow is the outbox rows' ceiling: RunConfirmPublisher.
const rawPublisherRow = "raw confirming publisher"

func summarizeOutbox(name string, runs []outboxRun) OutboxResult {
	res := OutboxResult{Row: name, Runs: len(runs), Messages: runs[0].messages}
	pick := func(f func(outboxRun) float64) float64 {
		v := make([]float64, len(runs))
		for i, r := range runs {
			v[i] = f(r)
		}
		return median(v)
	}
	per := func(secs float64, r outboxRun) float64 { return secs * 1e6 / float64(max(r.messages, 1)) }
	res.Rate = pick(func(r outboxRun) float64 { return r.rate })
	res.CPUProcs = pick(func(r outboxRun) float64 { return per(r.procs, r) })
	res.CPUPostgres = pick(func(r outboxRun) float64 { return per(r.pg, r) })
	res.CPURabbitMQ = pick(func(r outboxRun) float64 { return per(r.rabbit, r) })
	if len(runs[0].lat) > 0 {
		res.P50 = pick(func(r outboxRun) float64 { return ms(pct(r.lat, 0.50)) })
		res.P99 = pick(func(r outboxRun) float64 { return ms(pct(r.lat, 0.99)) })
		res.Max = pick(func(r outboxRun) float64 { return ms(pct(r.lat, 1)) })
	}
	for _, r := range runs {
		res.Lost += r.lost
		res.Doubled += r.doubled
	}
	return res
}

// PrintOutbox writes the outbox rows' table.
func PrintOutbox(w io.Writer, rs []OutboxResult) {
	fmt.Fprintln(w, "| outbox row | msg/s | × raw confirming publisher | CPU µs/msg: relays (or all processes) | Postgres | RabbitMQ | p50 ms | p99 ms | max ms | lost | doubled |")
	fmt.Fprintln(w, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
	for _, r := range rs {
		lat := "– | – | –"
		if r.P99 > 0 {
			lat = fmt.Sprintf("%.1f | %.1f | %.1f", r.P50, r.P99, r.Max)
		}
		ofRaw := "–"
		if r.OfRaw > 0 {
			ofRaw = fmt.Sprintf("%.2f×", r.OfRaw)
		}
		fmt.Fprintf(w, "| %s | %.0f | %s | %.0f | %.0f | %.0f | %s | %d | %d |\n", r.Row, r.Rate, ofRaw, r.CPUProcs, r.CPUPostgres, r.CPURabbitMQ, lat, r.Lost, r.Doubled)
	}
}

type outboxBench struct {
	o     OutboxOptions
	admin *pgxpool.Pool
}

// schema makes a schema with idem's tables (and, for two hops, the
// payments set) and returns a pool on it, its URL and a cleanup.
func (b *outboxBench) schema(ctx context.Context, name string, sets ...migrations.Set) (*pgxpool.Pool, string, func(), error) {
	if _, err := b.admin.Exec(ctx, "CREATE SCHEMA "+name); err != nil {
		return nil, "", nil, err
	}
	drop := func() {
		c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = b.admin.Exec(c, "DROP SCHEMA "+name+" CASCADE")
	}
	u := sandbox.WithParam(b.o.DatabaseURL, "search_path", name)
	pool, err := pgxpool.New(ctx, u)
	if err == nil {
		for _, s := range append([]migrations.Set{migrations.Guard}, sets...) {
			if _, err = migrations.ApplySet(ctx, pool, s); err != nil {
				break
			}
		}
	}
	if err != nil {
		if pool != nil {
			pool.Close()
		}
		drop()
		return nil, "", nil, err
	}
	return pool, u, func() { pool.Close(); drop() }, nil
}

// declare declares a quorum queue of the run's own and returns a cleanup.
func (b *outboxBench) declare(name string) (func(), error) {
	t := broker.TopologyFor(name, 0)
	if err := sandbox.DeclareTopology(b.o.AMQPURL, t); err != nil {
		return nil, err
	}
	return func() { deleteQueue(b.o.AMQPURL, t) }, nil
}

// drainer consumes queue (auto-ack) and records when each message ID
// arrived, until stop.
type drainer struct {
	mu   sync.Mutex
	got  map[string]time.Time
	dups int
	done chan struct{}
	conn *amqp.Connection
}

func startDrainer(url, queue string) (*drainer, error) {
	conn, err := amqp.Dial(url)
	if err != nil {
		return nil, err
	}
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Qos(2000, 0, false)
	}
	var ds <-chan amqp.Delivery
	if err == nil {
		ds, err = ch.Consume(queue, "", false, false, false, false, nil)
	}
	if err != nil {
		conn.Close()
		return nil, err
	}
	d := &drainer{got: map[string]time.Time{}, done: make(chan struct{}), conn: conn}
	go func() {
		defer close(d.done)
		n := 0
		for m := range ds {
			now := time.Now()
			d.mu.Lock()
			if _, seen := d.got[m.MessageId]; seen {
				d.dups++
			} else {
				d.got[m.MessageId] = now
			}
			d.mu.Unlock()
			if n++; n%500 == 0 {
				_ = m.Ack(true)
			}
		}
	}()
	return d, nil
}

func (d *drainer) count() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.got)
}

func (d *drainer) stop() { d.conn.Close(); <-d.done }

// prefill inserts n pending rows bound for destination "q".
const prefill = `INSERT INTO idem_outbox (scope, event_id, idx, destination, key, lane, type, body)
SELECT 'bench', 'evt_' || g, 0, 'q', 'user_' || (g % 1000), (g % 1000) % 32, 'RECEIPT_REQUESTED',
	convert_to('{"type":"RECEIPT_REQUESTED","paymentId":"evt_' || g || '","userId":"user_' || (g % 1000) || '","amount":1000}', 'UTF8')
FROM generate_series(1, $1) g`

// throughput relays a prefilled outbox with relays processes. With drain, a
// consumer in this process takes the messages off the destination queue as
// they arrive (its broker work is charged to the row); without, they stay
// in the queue, as for a receiving service on other machines, and the row
// ends when every row is marked sent.
func (b *outboxBench) throughput(ctx context.Context, bin string, run, relays int, drain bool) (outboxRun, error) {
	name := fmt.Sprintf("idem_bench_ob_%d_%d_%t_%d", relays, run, drain, os.Getpid())
	if bin != b.o.Bin {
		name += "_baseline"
	}
	pool, u, drop, err := b.schema(ctx, name)
	if err != nil {
		return outboxRun{}, err
	}
	defer drop()
	undeclare, err := b.declare(name)
	if err != nil {
		return outboxRun{}, err
	}
	defer undeclare()
	if _, err := pool.Exec(ctx, prefill, b.o.Messages); err != nil {
		return outboxRun{}, err
	}
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE idem_outbox"); err != nil {
		return outboxRun{}, err
	}
	var d *drainer
	if drain {
		if d, err = startDrainer(b.o.AMQPURL, name); err != nil {
			return outboxRun{}, err
		}
		defer d.stop()
	}
	env := []string{"DATABASE_URL=" + u, "AMQP_URL=" + b.o.AMQPURL, "IDEM_OUTBOX_DESTINATIONS=q=queue:" + name}
	before, err := sampleCPU(nil)
	if err != nil {
		return outboxRun{}, err
	}
	start := time.Now()
	var procs []*fleet.Proc
	defer func() {
		for _, p := range procs {
			p.Kill()
		}
	}()
	for i := range relays {
		p, err := fleet.Start(fleet.Spec{Bin: bin, Command: "relay", Name: fmt.Sprintf("%s-relay%d", name, i), Dir: b.o.Dir, Env: env})
		if err != nil {
			return outboxRun{}, err
		}
		procs = append(procs, p)
	}
	deadline := time.Now().Add(5 * time.Minute)
	for {
		done, err := b.relayed(ctx, pool, d)
		if err != nil {
			return outboxRun{}, err
		}
		if done >= b.o.Messages {
			break
		}
		if time.Now().After(deadline) {
			return outboxRun{}, fmt.Errorf("%d of %d messages relayed in 5m", done, b.o.Messages)
		}
		time.Sleep(5 * time.Millisecond)
	}
	elapsed := time.Since(start)
	r := outboxRun{messages: b.o.Messages, rate: float64(b.o.Messages) / elapsed.Seconds()}
	after, err := sampleCPU(pids(procs)) // the relays count from zero
	if err != nil {
		return r, err
	}
	delta := cpuDelta(before, after)
	r.procs, r.pg, r.rabbit = delta[TierConsumer], delta[TierPostgres], delta[TierRabbitMQ]
	// The drainer can hold every message before the relays' last passes
	// have marked their rows and committed: give them a pass's bound to
	// do so before counting what was never sent.
	deadline = time.Now().Add(relay.Config{}.WithDefaults().TxBound())
	for {
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem_outbox WHERE state <> 'sent'`).Scan(&r.lost); err != nil {
			return r, err
		}
		if r.lost == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if d != nil {
		d.mu.Lock()
		r.doubled = d.dups
		d.mu.Unlock()
	}
	return r, nil
}

// rawPublisher measures RunConfirmPublisher as throughput measures a
// drained relay: Messages messages to a quorum queue of the run's own, a
// consumer in this process taking them off it, timed from the process's
// start until the consumer has them all; its CPU is the process's. It
// keeps as many publishes in flight as one relay pass (the relay's
// BatchSize).
func (b *outboxBench) rawPublisher(ctx context.Context, run int) (outboxRun, error) {
	name := fmt.Sprintf("idem_bench_obraw_%d_%d", run, os.Getpid())
	undeclare, err := b.declare(name)
	if err != nil {
		return outboxRun{}, err
	}
	defer undeclare()
	d, err := startDrainer(b.o.AMQPURL, name)
	if err != nil {
		return outboxRun{}, err
	}
	defer d.stop()
	env := []string{"DATABASE_URL=" + b.o.DatabaseURL, "AMQP_URL=" + b.o.AMQPURL, "REDIS_URL=" + b.o.RedisURL, "IDEM_QUEUE=" + name}
	args := []string{"--mode", "confirm-publish", "--messages", fmt.Sprint(b.o.Messages),
		"--in-flight", fmt.Sprint(relay.Config{}.WithDefaults().BatchSize)}
	before, err := sampleCPU(nil)
	if err != nil {
		return outboxRun{}, err
	}
	start := time.Now()
	p, err := fleet.Start(fleet.Spec{Bin: b.o.Bin, Command: "bench-worker", Name: name + "-publisher", Dir: b.o.Dir, Env: env, Args: args, Handshake: true})
	if err != nil {
		return outboxRun{}, err
	}
	defer p.Kill()
	if err := p.Release(); err != nil {
		return outboxRun{}, err
	}
	deadline := time.Now().Add(5 * time.Minute)
	for d.count() < b.o.Messages {
		select {
		case <-p.Done():
			return outboxRun{}, fmt.Errorf("%s exited with %d of %d messages delivered: %v", p.Name, d.count(), b.o.Messages, p.Err())
		case <-ctx.Done():
			return outboxRun{}, ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return outboxRun{}, fmt.Errorf("%d of %d messages delivered in 5m", d.count(), b.o.Messages)
		}
	}
	elapsed := time.Since(start)
	after, err := sampleCPU([]int{p.PID()}) // the publisher counts from zero
	if err != nil {
		return outboxRun{}, err
	}
	delta := cpuDelta(before, after)
	r := outboxRun{messages: b.o.Messages, rate: float64(b.o.Messages) / elapsed.Seconds(),
		procs: delta[TierConsumer], pg: delta[TierPostgres], rabbit: delta[TierRabbitMQ]}
	d.mu.Lock()
	r.doubled = d.dups
	d.mu.Unlock()
	return r, p.Stop(time.Minute)
}

// relayed is how many messages reached the destination: those the drainer
// took, or without one the rows marked sent.
func (b *outboxBench) relayed(ctx context.Context, pool *pgxpool.Pool, d *drainer) (int, error) {
	if d != nil {
		return d.count(), nil
	}
	time.Sleep(45 * time.Millisecond) // a cheap probe, not too often: its work is charged to the row
	var left bool
	if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM idem_outbox WHERE state = 'pending')`).Scan(&left); err != nil || left {
		return 0, err
	}
	return b.o.Messages, nil
}

func pids(ps []*fleet.Proc) []int {
	out := make([]int, len(ps))
	for i, p := range ps {
		out[i] = p.PID()
	}
	return out
}

// latency commits Rate messages a second through the guard, 5ms worth per
// transaction, for LatencyFor, with one relay running, and measures each
// message from its transaction's commit to its delivery to a consumer.
func (b *outboxBench) latency(ctx context.Context, run int) (outboxRun, error) {
	name := fmt.Sprintf("idem_bench_obl_%d_%d", run, os.Getpid())
	pool, u, drop, err := b.schema(ctx, name)
	if err != nil {
		return outboxRun{}, err
	}
	defer drop()
	undeclare, err := b.declare(name)
	if err != nil {
		return outboxRun{}, err
	}
	defer undeclare()
	d, err := startDrainer(b.o.AMQPURL, name)
	if err != nil {
		return outboxRun{}, err
	}
	defer d.stop()
	env := []string{"DATABASE_URL=" + u, "AMQP_URL=" + b.o.AMQPURL, "IDEM_OUTBOX_DESTINATIONS=q=queue:" + name}
	p, err := fleet.Start(fleet.Spec{Bin: b.o.Bin, Command: "relay", Name: name + "-relay", Dir: b.o.Dir, Env: env})
	if err != nil {
		return outboxRun{}, err
	}
	defer p.Kill()
	if err := waitLog(p, "msg=relaying", 30*time.Second); err != nil {
		return outboxRun{}, err
	}
	g, err := guard.New(guard.Config{Scope: "bench", Store: pgtier.New(pool)})
	if err != nil {
		return outboxRun{}, err
	}
	const tick = 5 * time.Millisecond
	per := max(1, int(b.o.Rate*tick.Seconds()))
	committed := map[string]time.Time{}
	before, err := sampleCPU([]int{p.PID()})
	if err != nil {
		return outboxRun{}, err
	}
	t := time.NewTicker(tick)
	defer t.Stop()
	end := time.Now().Add(b.o.LatencyFor)
	n := 0
	for time.Now().Before(end) {
		<-t.C
		evs := make([]guard.Event, per)
		for i := range evs {
			id := fmt.Sprintf("evt_%d", n+i)
			evs[i] = guard.Event{ID: id, Hash: guard.HashFields(id), ShardKey: fmt.Sprintf("user_%d", (n+i)%1000)}
		}
		_, err := g.ProcessBatch(ctx, evs, func(ctx context.Context, tx pgx.Tx, claimed []int) error {
			msgs := make([]outbox.Message, len(claimed))
			for k, i := range claimed {
				msgs[k] = outbox.Message{EventID: evs[i].ID, To: "q", Key: evs[i].ShardKey, Body: []byte(evs[i].ID)}
			}
			return outbox.Enqueue(ctx, tx, msgs...)
		})
		if err != nil {
			return outboxRun{}, err
		}
		at := time.Now()
		for _, ev := range evs {
			committed[outbox.ID("bench", ev.ID, 0)] = at
		}
		n += per
	}
	deadline := time.Now().Add(time.Minute)
	for d.count() < n && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	after, err := sampleCPU([]int{p.PID()})
	if err != nil {
		return outboxRun{}, err
	}
	delta := cpuDelta(before, after)
	r := outboxRun{messages: n, rate: b.o.Rate, procs: delta[TierConsumer], pg: delta[TierPostgres], rabbit: delta[TierRabbitMQ]}
	d.mu.Lock()
	defer d.mu.Unlock()
	r.doubled = d.dups
	for id, c := range committed {
		got, ok := d.got[id]
		if !ok {
			r.lost++
			continue
		}
		r.lat = append(r.lat, max(0, got.Sub(c)))
	}
	return r, nil
}

// twoHops runs the reference pipeline at Rate for LatencyFor: payments
// consumers that send a RECEIPT_REQUESTED each through the outbox (and
// relay it), receipts consumers that record them; each payment is measured
// from its ledger row's transaction to its receipt's.
func (b *outboxBench) twoHops(ctx context.Context, run int) (outboxRun, error) {
	name := fmt.Sprintf("idem_bench_ob2_%d_%d", run, os.Getpid())
	_, u, drop, err := b.schema(ctx, name)
	if err != nil {
		return outboxRun{}, err
	}
	defer drop()
	pool, err := pgxpool.New(ctx, u)
	if err != nil {
		return outboxRun{}, err
	}
	defer pool.Close()
	// The consumers' Redis keys go with the run (done markers live for a
	// day: left behind, 20,000 a run fill the shared Redis).
	rdb, err := redisClient(b.o.RedisURL)
	if err != nil {
		return outboxRun{}, err
	}
	defer rdb.Close()
	defer deleteKeys(rdb, name)
	rq := name + ".receipts"
	defer deleteQueue(b.o.AMQPURL, broker.TopologyFor(name, 0))
	defer deleteQueue(b.o.AMQPURL, broker.TopologyFor(rq, 0))
	env := []string{"DATABASE_URL=" + u, "AMQP_URL=" + b.o.AMQPURL, "REDIS_URL=" + b.o.RedisURL, "IDEM_REDIS_PREFIX=" + name,
		"IDEM_QUEUE=" + name, "IDEM_OUTBOX_DESTINATIONS=receipts=queue:" + rq}
	receipts := append(slices.Clone(env), "IDEM_HANDLER=receipts", "IDEM_SCOPE=receipts", "IDEM_QUEUE="+rq)
	payments := append(slices.Clone(env), "IDEM_OUTBOX_EMIT=receipts", "IDEM_OUTBOX_RELAY=true")
	var procs []*fleet.Proc
	defer func() {
		for _, p := range procs {
			p.Kill()
		}
	}()
	for i, e := range [][]string{receipts, payments} {
		p, err := fleet.Start(fleet.Spec{Bin: b.o.Bin, Name: fmt.Sprintf("%s-%d", name, i), Dir: b.o.Dir, Env: e})
		if err != nil {
			return outboxRun{}, err
		}
		procs = append(procs, p)
		if err := waitLog(p, "msg=consuming", time.Minute); err != nil {
			return outboxRun{}, err
		}
	}
	count := int(b.o.Rate * b.o.LatencyFor.Seconds())
	before, err := sampleCPU(pids(procs))
	if err != nil {
		return outboxRun{}, err
	}
	pub := exec.CommandContext(ctx, b.o.Bin, "publish", "--quiet", "--count", fmt.Sprint(count), "--dup-ratio", "0",
		"--users", "1000", "--rate", fmt.Sprint(b.o.Rate), "--seed", fmt.Sprint(run+1))
	pub.Env = append(os.Environ(), env...)
	if out, err := pub.CombinedOutput(); err != nil {
		return outboxRun{}, fmt.Errorf("idem publish: %v: %s", err, out)
	}
	deadline := time.Now().Add(2 * time.Minute)
	var got int
	for time.Now().Before(deadline) {
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM receipts`).Scan(&got); err != nil {
			return outboxRun{}, err
		}
		if got >= count {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	after, err := sampleCPU(pids(procs))
	if err != nil {
		return outboxRun{}, err
	}
	delta := cpuDelta(before, after)
	r := outboxRun{messages: count, rate: b.o.Rate, procs: delta[TierConsumer], pg: delta[TierPostgres], rabbit: delta[TierRabbitMQ]}
	rows, err := pool.Query(ctx, `SELECT (extract(epoch FROM r.created_at - l.applied_at) * 1e6)::bigint
		FROM receipts r JOIN payments_ledger l ON l.event_id = r.payment_id`)
	if err != nil {
		return r, err
	}
	micros, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		return r, err
	}
	for _, m := range micros {
		r.lat = append(r.lat, time.Duration(m)*time.Microsecond)
	}
	if err := pool.QueryRow(ctx, `SELECT $1 - count(DISTINCT payment_id), count(*) - count(DISTINCT payment_id) FROM receipts`, count).Scan(&r.lost, &r.doubled); err != nil {
		return r, err
	}
	return r, nil
}

func waitLog(p *fleet.Proc, s string, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for !p.LogContains(s) {
		select {
		case <-p.Done():
			b, _ := os.ReadFile(p.LogPath)
			return fmt.Errorf("%s exited: %v\n%s", p.Name, p.Err(), b)
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s: no %q in %s after %s", p.Name, s, filepath.Base(p.LogPath), limit)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return nil
}

// pct is the p-th quantile of v (sorting it).
func pct(v []time.Duration, p float64) time.Duration {
	if len(v) == 0 {
		return 0
	}
	slices.Sort(v)
	i := int(p * float64(len(v)-1))
	return v[i]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
