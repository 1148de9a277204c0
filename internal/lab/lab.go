// Package lab runs the approaches people weigh for deduplicating an
// at-least-once stream side by side, on the same workload and the same
// faults, and measures what each one does: doubled effects, lost events,
// round trips, throughput, and behaviour while Redis is down. It is
// `idem-lab lab`; `idem-lab lab-worker` is one of its worker processes.
package lab

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/crashpoint"
	"github.com/idemhq/idem/internal/fleet"
	"github.com/idemhq/idem/internal/loadgen"
	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/verify"
)

// Options describe a lab run.
type Options struct {
	Bin         string // the idem binary, for the worker processes
	Dir         string // worker logs and stats
	AMQPURL     string
	DatabaseURL string // each pass gets a schema of its own here
	// PGLatency, if set, puts the workers' Postgres behind a proxy that
	// adds it each way: a primary in another zone, on one machine.
	PGLatency  time.Duration
	Approaches []string
	Events     int     // distinct events per pass
	DupRatio   float64 // re-sends, half back-to-back, half delayed
	Users      int
	Seed       uint64
	Processes  int // worker processes per pass
	Workers    int // goroutines per process
	Prefetch   int
	TTL        time.Duration // key TTL of the Redis approaches
	Outage     time.Duration // how long Redis stays down in the Redis pass
	Drain      time.Duration // how long a pass may take to empty its queue
	// Runs repeats the clean pass; the table shows the median of each
	// number.
	Runs     int
	Progress io.Writer
}

// The passes every approach runs, each on a fresh schema, queue and Redis.
const (
	PassClean = "clean" // no faults: races only, and the cost
	PassCrash = "crash" // SIGKILL after the check, SIGKILL after the effect, Postgres sessions terminated
	PassRedis = "redis" // Redis killed (down, then back empty), later flushed
)

// Passes lists the passes in the order they run.
var Passes = []string{PassClean, PassCrash, PassRedis}

// Pass is what one approach did in one pass.
type Pass struct {
	Messages   int     `json:"messages"`
	Distinct   int     `json:"distinct"`
	Doubled    int     `json:"doubled"` // events applied more than once
	Extra      int64   `json:"extra"`   // effects beyond one per event
	Lost       int     `json:"lost"`    // events never applied
	Stuck      int     `json:"stuck"`   // messages left when the pass gave up
	Applied    int64   `json:"applied"`
	Duplicates int64   `json:"duplicates"`
	Requeued   int64   `json:"requeued"`
	PGTrips    float64 `json:"pgTripsPerMessage"`
	RedisTrips float64 `json:"redisTripsPerMessage"`
	Seconds    float64 `json:"seconds"`
	Rate       float64 `json:"messagesPerSecond"`
	// Redis pass: acks per second while Redis was down.
	OutageRate float64 `json:"outageMessagesPerSecond,omitempty"`
	// Downstream approaches: payments whose message never left, messages
	// sent by an attempt that did not commit, and messages delivered
	// again (with the same message ID).
	DownLost    int      `json:"downstreamLost,omitempty"`
	DownPhantom int      `json:"downstreamPhantom,omitempty"`
	DownTwice   int      `json:"downstreamTwice,omitempty"`
	Crashes     []string `json:"crashes,omitempty"` // steps armed workers died at
}

// Row is one approach's passes.
type Row struct {
	Approach string          `json:"approach"`
	Title    string          `json:"title"`
	Passes   map[string]Pass `json:"passes"`
}

func (o *Options) validate() error {
	for _, a := range o.Approaches {
		if _, ok := Titles[a]; !ok {
			return fmt.Errorf("lab: unknown approach %q (want one of %s)", a, strings.Join(Approaches, ", "))
		}
	}
	switch {
	case len(o.Approaches) == 0:
		return errors.New("lab: no approach to run")
	case o.Events < 100:
		return fmt.Errorf("lab: --events must be at least 100, got %d", o.Events)
	case o.Processes < 2:
		return fmt.Errorf("lab: --processes must be at least 2 (one is armed per crash), got %d", o.Processes)
	case o.Workers < 1 || o.Prefetch < 1:
		return errors.New("lab: --workers and --prefetch must be positive")
	case o.Runs < 1:
		return fmt.Errorf("lab: --runs must be at least 1, got %d", o.Runs)
	case o.Outage < time.Second:
		return fmt.Errorf("lab: --outage must be at least 1s, got %s", o.Outage)
	case o.DupRatio <= 0 || o.DupRatio > 10:
		return fmt.Errorf("lab: --dup-ratio must be in (0, 10], got %g", o.DupRatio)
	}
	if o.Progress == nil {
		o.Progress = io.Discard
	}
	return nil
}

// Run runs every pass of every approach in turn.
func Run(ctx context.Context, o Options) ([]Row, error) {
	if err := o.validate(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(o.Dir, 0o755); err != nil {
		return nil, err
	}
	rdir := filepath.Join(o.Dir, "redis")
	if err := os.MkdirAll(rdir, 0o755); err != nil {
		return nil, err
	}
	rs, err := sandbox.StartRedis(rdir)
	if err != nil {
		return nil, fmt.Errorf("lab: the Redis pass needs a redis-server of its own: %w", err)
	}
	defer rs.Kill()
	spec := loadgen.StreamSpec{RunID: loadgen.RunID(o.Seed), Count: o.Events, Users: o.Users,
		DupRatio: o.DupRatio, DelayWindow: 500, Seed: o.Seed}
	stream, err := loadgen.Build(spec)
	if err != nil {
		return nil, fmt.Errorf("lab: %w", err)
	}
	fmt.Fprintf(o.Progress, "lab %s: %d events + %d re-sends (%d back-to-back), %d processes x %d workers, files in %s\n",
		spec.RunID, len(stream.Events), stream.BackToBack+stream.Delayed, stream.BackToBack, o.Processes, o.Workers, o.Dir)
	var pgProxy string
	if o.PGLatency > 0 {
		u, err := url.Parse(o.DatabaseURL)
		if err != nil || u.Host == "" {
			return nil, fmt.Errorf("lab: --pg-latency needs DATABASE_URL as a postgres:// URL with a host")
		}
		px, err := sandbox.StartDelayProxy(u.Host, o.PGLatency)
		if err != nil {
			return nil, err
		}
		defer px.Close()
		pgProxy = px.Addr()
		direct, err := roundTrip(ctx, o.DatabaseURL)
		if err != nil {
			return nil, err
		}
		u.Host = pgProxy
		proxied, err := roundTrip(ctx, u.String())
		if err != nil {
			return nil, err
		}
		fmt.Fprintf(o.Progress, "workers reach Postgres through a proxy adding %s each way: a round trip takes %s (direct: %s)\n",
			o.PGLatency, proxied.Round(10*time.Microsecond), direct.Round(10*time.Microsecond))
	}
	var rows []Row
	for _, a := range o.Approaches {
		row := Row{Approach: a, Title: Titles[a], Passes: map[string]Pass{}}
		for _, pass := range Passes {
			runs := 1
			if pass == PassClean {
				runs = o.Runs
			}
			var results []Pass
			for run := range runs {
				p := &passRun{o: o, approach: a, pass: pass, attempt: run, redis: rs, spec: spec, stream: stream, pgProxy: pgProxy}
				res, err := p.run(ctx)
				if err != nil {
					return rows, fmt.Errorf("lab: %s, %s pass: %w", a, pass, err)
				}
				fmt.Fprintf(o.Progress, "  %-18s %-5s %5.1fs  doubled %4d  lost %4d  %6.0f msg/s\n",
					a, pass, res.Seconds, res.Doubled, res.Lost, res.Rate)
				results = append(results, res)
			}
			row.Passes[pass] = median(results)
		}
		rows = append(rows, row)
	}
	return rows, nil
}

type passRun struct {
	o        Options
	approach string
	pass     string
	attempt  int
	redis    *sandbox.Redis
	spec     loadgen.StreamSpec
	stream   loadgen.Stream

	name    string // schema, queue, connection and application name
	pool    *pgxpool.Pool
	dbURL   string
	pgProxy string // host:port of the latency proxy, if any
	inspect *sandbox.Inspector
	queue   string
	workers *workerSet
}

func (p *passRun) run(ctx context.Context) (Pass, error) {
	p.name = fmt.Sprintf("lab_%s_%s_%s%d", p.spec.RunID, strings.ReplaceAll(p.approach, "-", "_"), p.pass, p.attempt)
	p.queue = "idem." + p.name
	if err := p.redis.Do(ctx, "FLUSHALL"); err != nil {
		return Pass{}, err
	}
	drop, err := p.schema(ctx)
	if err != nil {
		return Pass{}, err
	}
	defer drop()
	defer func() { _ = sandbox.DeleteQueue(p.o.AMQPURL, p.queue) }()
	downstream := slices.Contains(Downstream, p.approach)
	if downstream {
		if err := declareQueue(p.o.AMQPURL, downstreamQueue(p.queue)); err != nil {
			return Pass{}, err
		}
		defer func() { _ = sandbox.DeleteQueue(p.o.AMQPURL, downstreamQueue(p.queue)) }()
	}
	p.inspect = sandbox.NewInspector(p.o.AMQPURL)
	defer p.inspect.Close()
	if err := loadgen.Publish(ctx, loadgen.PublishOptions{URL: p.o.AMQPURL, ConnectionName: p.name + "_publish",
		Topology: broker.TopologyFor(p.queue, 0)}, p.stream); err != nil {
		return Pass{}, err
	}
	m := loadgen.NewManifest(p.spec, p.queue, p.stream)

	rng := rand.New(rand.NewPCG(p.o.Seed, uint64(len(p.pass))))
	share := int64(len(p.stream.Order) / p.o.Processes)
	armed := map[int][]string{}
	if p.pass == PassCrash {
		// One worker dies after its check, one after its effect, each
		// early in its share of the stream.
		arm := func(step string) []string {
			return []string{crashpoint.EnvAt + "=" + step, crashpoint.EnvAfter + "=" + strconv.FormatInt(share/10+rng.Int64N(share/5+1), 10)}
		}
		armed[0], armed[1] = arm(AfterCheck), arm(AfterEffect)
	}
	start := time.Now()
	if p.workers, err = startWorkers(p, armed); err != nil {
		return Pass{}, err
	}
	faults := make(chan faultResult, 1)
	fctx, stopFaults := context.WithCancel(ctx)
	go func() { faults <- p.faults(fctx) }()
	stuck, err := p.drain(ctx)
	stopFaults()
	fr := <-faults
	if err == nil && p.approach == "outbox" {
		err = p.waitOutbox(ctx)
	}
	p.workers.stop()
	if err != nil {
		return Pass{}, err
	}
	if fr.err != nil {
		return Pass{}, fr.err
	}

	r, err := verify.Check(ctx, p.pool, m)
	if err != nil {
		return Pass{}, err
	}
	st := p.workers.stats()
	res := Pass{Messages: m.Messages, Distinct: r.Distinct, Doubled: r.Doubled, Extra: r.LedgerRows - int64(r.Distinct-r.Missing),
		Lost: r.Missing, Stuck: stuck, Applied: st.Applied, Duplicates: st.Duplicate, Requeued: st.Requeued,
		PGTrips: float64(st.PGTrips) / float64(m.Messages), RedisTrips: float64(st.RedisTrip) / float64(m.Messages),
		OutageRate: fr.outageRate, Crashes: p.workers.crashes()}
	if downstream {
		dr, err := p.countDownstream(ctx)
		if err != nil {
			return Pass{}, err
		}
		res.DownLost, res.DownPhantom, res.DownTwice = dr.lost, dr.phantom, dr.twice
	}
	end := time.Unix(0, st.LastAck)
	if st.LastAck == 0 || end.Before(start) {
		end = time.Now()
	}
	res.Seconds = end.Sub(start).Seconds()
	res.Rate = float64(m.Messages) / res.Seconds
	return res, nil
}

// schema creates the pass's schema with idem's tables and the lab's, and
// returns how to drop it.
func (p *passRun) schema(ctx context.Context) (func(), error) {
	admin, err := pgx.Connect(ctx, p.o.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("connect to postgres: %w", err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+p.name); err != nil {
		return nil, err
	}
	drop := func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if c, err := pgx.Connect(ctx, p.o.DatabaseURL); err == nil {
			_, _ = c.Exec(ctx, "DROP SCHEMA "+p.name+" CASCADE")
			c.Close(ctx)
		}
		if p.pool != nil {
			p.pool.Close()
		}
	}
	// The workers' sessions carry the pass's application_name, so the
	// crash pass terminates theirs and not the lab's own.
	own := sandbox.WithParam(p.o.DatabaseURL, "search_path", p.name)
	p.dbURL = sandbox.WithParam(own, "application_name", p.name)
	if p.pgProxy != "" {
		u, err := url.Parse(p.dbURL)
		if err != nil {
			drop()
			return nil, err
		}
		u.Host = p.pgProxy
		p.dbURL = u.String()
	}
	if p.pool, err = pgxpool.New(ctx, own); err != nil {
		drop()
		return nil, err
	}
	if _, err := payments.Migrate(ctx, p.pool); err != nil {
		drop()
		return nil, err
	}
	// lab_seen has an index, as anyone would add for the lookup, but no
	// unique constraint: that is approach 1.
	if _, err := p.pool.Exec(ctx, `CREATE TABLE lab_seen (event_id text NOT NULL);
		CREATE INDEX lab_seen_event_id ON lab_seen (event_id);
		CREATE TABLE lab_processed (event_id text PRIMARY KEY);
		CREATE TABLE lab_downstream (event_id text NOT NULL, token text NOT NULL)`); err != nil {
		drop()
		return nil, err
	}
	return drop, nil
}

type faultResult struct {
	outageRate float64
	err        error
}

// faults injects the pass's faults at points of progress through the
// queue: in the crash pass, Postgres sessions are terminated at 50%; in the
// Redis pass, Redis is killed at 30% and started again (empty) after
// Outage, and flushed at 70%.
func (p *passRun) faults(ctx context.Context) faultResult {
	var fr faultResult
	at := func(frac float64) bool {
		for {
			left, err := p.inspect.Ready(p.queue)
			if err != nil {
				fr.err = err
				return false
			}
			if float64(left) <= (1-frac)*float64(len(p.stream.Order)) {
				return true
			}
			select {
			case <-ctx.Done():
				return false
			case <-time.After(20 * time.Millisecond):
			}
		}
	}
	switch p.pass {
	case PassCrash:
		if at(0.5) {
			_, fr.err = p.pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
				WHERE application_name = $1`, p.name)
		}
	case PassRedis:
		if !at(0.3) {
			return fr
		}
		p.redis.Kill()
		down := time.Now()
		// Workers write their counts every 100ms: start counting once the
		// counts no longer include acks from before the kill.
		time.Sleep(250 * time.Millisecond)
		before, t0 := p.workers.stats().Acked, time.Now()
		select {
		case <-ctx.Done():
		case <-time.After(time.Until(down.Add(p.o.Outage))):
		}
		after, t1 := p.workers.stats().Acked, time.Now()
		fr.outageRate = float64(after-before) / t1.Sub(t0).Seconds()
		if fr.err = p.redis.Start(); fr.err != nil {
			return fr
		}
		if at(0.7) {
			fr.err = p.redis.Do(context.Background(), "FLUSHALL")
		}
	}
	return fr
}

// drain waits until the queue holds no message, ready or unacked, or Drain
// passes; it returns the messages left.
func (p *passRun) drain(ctx context.Context) (int, error) {
	deadline := time.Now().Add(p.o.Drain)
	for {
		ready, err := p.inspect.Ready(p.queue)
		if err != nil {
			return 0, err
		}
		if ready == 0 {
			// Unacked messages show only in the broker's own listing.
			total, err := queueMessages(p.queue)
			if err != nil {
				return 0, err
			}
			if total == 0 {
				return 0, nil
			}
		}
		if err := p.workers.err(); err != nil {
			return 0, err
		}
		if time.Now().After(deadline) {
			total, err := queueMessages(p.queue)
			return total, err
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// queueMessages is ready plus unacked messages, from rabbitmqctl.
func queueMessages(queue string) (int, error) {
	out, err := exec.Command("rabbitmqctl", "-q", "list_queues", "--no-table-headers", "name", "messages").Output()
	if err != nil {
		return 0, fmt.Errorf("rabbitmqctl list_queues: %w", err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		if name, n, ok := strings.Cut(line, "\t"); ok && name == queue {
			return strconv.Atoi(strings.TrimSpace(n))
		}
	}
	return 0, fmt.Errorf("queue %s not listed by rabbitmqctl", queue)
}

// workerSet runs a pass's worker processes, restarting any that dies of a
// crash; one that fails with an error fails the pass.
type workerSet struct {
	*fleet.Group
	mu     sync.Mutex
	failed error
}

func startWorkers(p *passRun, armed map[int][]string) (*workerSet, error) {
	w := &workerSet{}
	args := []string{"--approach", p.approach, "--queue", p.queue, "--workers", strconv.Itoa(p.o.Workers),
		"--prefetch", strconv.Itoa(p.o.Prefetch), "--ttl", p.o.TTL.String()}
	env := []string{"AMQP_URL=" + p.o.AMQPURL, "DATABASE_URL=" + p.dbURL, "REDIS_URL=" + p.redis.URL()}
	g, err := fleet.StartGroup(fleet.GroupConfig{
		Size: p.o.Processes,
		Spec: func(slot, gen int) fleet.Spec {
			return fleet.Spec{Bin: p.o.Bin, Command: "lab-worker", Name: fmt.Sprintf("%s_w%d_%d", p.name, slot, gen),
				Dir: p.o.Dir, Args: args, Env: env}
		},
		RestartDelay: 200 * time.Millisecond,
		OnExit: func(pr *fleet.Proc, _ bool) bool {
			if pr.Killed() || pr.Err() == nil {
				return true
			}
			b, _ := os.ReadFile(pr.LogPath)
			w.mu.Lock()
			w.failed = fmt.Errorf("worker %s failed: %v\n%s", pr.Name, pr.Err(), b)
			w.mu.Unlock()
			return false
		},
	}, armed)
	w.Group = g
	return w, err
}

func (w *workerSet) err() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.failed
}

func (w *workerSet) stop() { w.Stop(10 * time.Second) }

// stats sums every worker's last counts, killed ones included (an armed
// worker writes its counts right before it dies).
func (w *workerSet) stats() WorkerStats {
	procs := w.Procs()
	var sum WorkerStats
	for _, p := range procs {
		var s WorkerStats
		if b, err := os.ReadFile(p.StatsPath); err == nil && json.Unmarshal(b, &s) == nil {
			sum.Acked += s.Acked
			sum.Applied += s.Applied
			sum.Duplicate += s.Duplicate
			sum.Requeued += s.Requeued
			sum.PGTrips += s.PGTrips
			sum.RedisTrip += s.RedisTrip
			sum.LastAck = max(sum.LastAck, s.LastAck)
		}
	}
	return sum
}

// crashes lists the steps at which armed workers died.
func (w *workerSet) crashes() []string {
	procs := w.Procs()
	var out []string
	for _, p := range procs {
		select {
		case <-p.Done():
		default:
			continue
		}
		if step, ok := p.CrashedAt(); ok {
			out = append(out, step)
		}
	}
	return out
}

// median returns the first pass with each measured number replaced by the
// median over passes.
func median(ps []Pass) Pass {
	out := ps[0]
	if len(ps) == 1 {
		return out
	}
	mid := func(get func(Pass) float64) float64 {
		v := make([]float64, len(ps))
		for i, p := range ps {
			v[i] = get(p)
		}
		slices.Sort(v)
		if len(v)%2 == 1 {
			return v[len(v)/2]
		}
		return (v[len(v)/2-1] + v[len(v)/2]) / 2
	}
	out.Doubled = int(mid(func(p Pass) float64 { return float64(p.Doubled) }))
	out.Lost = int(mid(func(p Pass) float64 { return float64(p.Lost) }))
	out.PGTrips = mid(func(p Pass) float64 { return p.PGTrips })
	out.RedisTrips = mid(func(p Pass) float64 { return p.RedisTrips })
	out.Seconds = mid(func(p Pass) float64 { return p.Seconds })
	out.Rate = mid(func(p Pass) float64 { return p.Rate })
	return out
}

// roundTrip is the median time of a `SELECT 1` on one connection.
func roundTrip(ctx context.Context, dbURL string) (time.Duration, error) {
	c, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return 0, err
	}
	defer c.Close(ctx)
	times := make([]time.Duration, 21)
	for i := range times {
		start := time.Now()
		if err := c.QueryRow(ctx, "SELECT 1").Scan(new(int)); err != nil {
			return 0, err
		}
		times[i] = time.Since(start)
	}
	slices.Sort(times)
	return times[len(times)/2], nil
}

// declareQueue declares a quorum queue.
func declareQueue(amqpURL, name string) error {
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	_, err = ch.QueueDeclare(name, true, false, false, false, amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum})
	return err
}
