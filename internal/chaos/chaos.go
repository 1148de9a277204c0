// Package chaos runs a fleet of `idem consume` processes on a stream with
// duplicates while a seeded schedule of faults hits the consumers, Redis,
// PostgreSQL and the broker connections, then checks that every event was
// applied exactly once and nothing was left behind. It is `idem-lab chaos`.
//
// A run owns everything it breaks: a redis-server and a PostgreSQL cluster
// started for it on free ports, a queue of its own on the shared broker,
// consumer connections named after the run, and the links (fault proxies)
// every consumer reaches each service through, so that breaking "their"
// connections touches no one else's.
package chaos

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/crashpoint"
	"github.com/idemhq/idem/internal/loadgen"
	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/step"
	"github.com/idemhq/idem/internal/telemetry"
	"github.com/idemhq/idem/internal/verify"
)

// Options describe a run. The same options and seed give the same stream
// and the same fault schedule.
type Options struct {
	Bin       string        // the idem binary: consumers and publisher
	Dir       string        // logs, stats, manifest and reports go here
	AMQPURL   string        // the broker; the run declares its own queue on it
	Consumers int           // fleet size
	Duration  time.Duration // how long the stream is published for
	Rate      float64       // messages per second, re-sends included
	DupRatio  float64       // re-sends as a fraction of distinct events
	Users     int           // distinct users the payments spread over
	Seed      uint64
	Faults    []Kind
	// Settle bounds how long the fleet may take, after the stream and the
	// last fault, to apply every event and empty the queue.
	Settle time.Duration
	// ConfigPath, if set, is passed to every consumer with --config.
	ConfigPath string
	// Cluster runs the fleet on distributed tiers of the run's own: a Redis
	// Cluster (three masters, one replica each), a three-node RabbitMQ
	// cluster with Partitions quorum queues, and two PostgreSQL shards.
	// AMQPURL is then unused.
	Cluster bool
	// Partitions is the queue partitions of a Cluster run. Defaults to 4.
	Partitions int
	// TwoHop adds the second hop: the payments consumers send a
	// RECEIPT_REQUESTED per payment through the outbox (each runs a
	// relay), a fleet of Consumers/2 receipts consumers records them and
	// POSTs each receipt through its own outbox to an API the run serves,
	// and the verdict checks both hops.
	TwoHop bool
	// AsyncStandby makes the standby of a pg-failover run asynchronous, as
	// streaming replication is by default: a failover then loses commits
	// the primary had acked, which the verdict names and the re-send
	// recovers, instead of failing the run. Otherwise it is synchronous.
	AsyncStandby bool
	// Progress receives a line per fault and phase.
	Progress io.Writer
}

func (o *Options) validate() error {
	switch {
	case o.Consumers < 1:
		return fmt.Errorf("chaos: --consumers must be at least 1, got %d", o.Consumers)
	case o.Duration < 10*time.Second:
		return fmt.Errorf("chaos: --duration must be at least 10s, got %s", o.Duration)
	case o.Rate <= 0:
		return fmt.Errorf("chaos: --rate must be positive, got %g", o.Rate)
	case o.DupRatio < 0 || o.DupRatio > 10:
		return fmt.Errorf("chaos: --dup-ratio must be in [0, 10], got %g", o.DupRatio)
	case o.Users < 1:
		return fmt.Errorf("chaos: --users must be at least 1, got %d", o.Users)
	case o.Settle <= 0:
		return fmt.Errorf("chaos: --settle must be positive, got %s", o.Settle)
	}
	for _, k := range TwoHopOnly {
		if slices.Contains(o.Faults, k) && !o.TwoHop {
			return fmt.Errorf("chaos: the %s fault needs the second hop (--two-hop)", k)
		}
	}
	if slices.Contains(o.Faults, RabbitKill) && !o.Cluster {
		return fmt.Errorf("chaos: the %s fault needs --cluster", RabbitKill)
	}
	for _, k := range SingleNodeOnly {
		if slices.Contains(o.Faults, k) && o.Cluster {
			return fmt.Errorf("chaos: the %s fault cannot hit a Redis Cluster: its clients reach the nodes directly; leave it out of a --cluster run", k)
		}
	}
	if o.AsyncStandby && !slices.Contains(o.Faults, PGFailover) {
		return fmt.Errorf("chaos: --async-standby needs the %s fault", PGFailover)
	}
	if o.AsyncStandby && o.Cluster {
		// A payment and its receipt may be on different shards: a lost
		// payment's receipt could outlive it.
		return fmt.Errorf("chaos: --async-standby cannot go with --cluster")
	}
	if o.Partitions > 1 && !o.Cluster {
		return fmt.Errorf("chaos: --partitions needs --cluster")
	}
	if o.Cluster && o.Partitions == 0 {
		o.Partitions = 4
	}
	if o.Progress == nil {
		o.Progress = io.Discard
	}
	return nil
}

// Run runs the scenario and returns its result; err is for a run that could
// not be carried out (a service would not start, the publisher failed), not
// for a failed verdict: see Result.OK.
func Run(ctx context.Context, o Options) (*Result, error) {
	if err := o.validate(); err != nil {
		return nil, err
	}
	r := &run{o: o, id: loadgen.RunID(o.Seed)}
	defer r.cleanup()
	return r.run(ctx)
}

type run struct {
	o     Options
	id    string
	queue string
	t0    time.Time

	redis     *sandbox.Redis        // a single-node run's Redis
	rcluster  *sandbox.RedisCluster // a cluster run's Redis
	rabbit    *sandbox.RabbitCluster
	pubNode   *sandbox.RabbitNode // the node the publisher uses: never stopped
	amqpURL   string              // the broker: one URL per node, comma-separated
	cuts      []*sandbox.AMQPCut  // relay-cut, amqp-close: a proxy in front of each node, on the consumers' way to it
	relayCuts int                 // relay-cut faults so far: they alternate between a publish and a confirm
	deletes   int                 // queue-delete faults so far: they take the receipts partitions in turn
	proxy     *sandbox.Faults     // the toxiproxy server the links run on
	links     []*links            // each consumer slot's: the payments fleet's, then the receipts fleet's
	pgs       []*sandbox.Postgres // the shards (one without --cluster)
	pools     []*pgxpool.Pool
	fo        *failoverState // a pg-failover run's: shard 0's pair and what its failovers undid
	published atomic.Bool    // the publisher is done
	restarts  int            // pg-restart faults so far: they take the shards in turn
	appName   string
	fleet     *consumers
	hop       *consumers // the receipts consumers of a two-hop run
	steps     []string   // the crash points the run arms
	api       *api       // the second hop's HTTP destination
	inspect   *sandbox.Inspector

	mu       sync.Mutex
	faults   []Fault
	timeline []Sample
	cleanups []func()
}

func (r *run) logf(format string, args ...any) {
	fmt.Fprintf(r.o.Progress, "[%6.1fs] %s\n", r.since(), fmt.Sprintf(format, args...))
}

func (r *run) since() float64 {
	if r.t0.IsZero() {
		return 0
	}
	return time.Since(r.t0).Seconds()
}

func (r *run) cleanup() {
	for i := len(r.cleanups) - 1; i >= 0; i-- {
		r.cleanups[i]()
	}
}

func (r *run) run(ctx context.Context) (*Result, error) {
	o := r.o
	if err := os.MkdirAll(o.Dir, 0o755); err != nil {
		return nil, fmt.Errorf("chaos: --dir: %w", err)
	}
	r.queue = "idem.chaos." + r.id
	r.appName = "idem_chaos_" + r.id
	if err := r.startServices(ctx); err != nil {
		return nil, err
	}

	distinct := max(1, int(o.Rate*o.Duration.Seconds()/(1+o.DupRatio)))
	slots, steps := o.Consumers, slices.Clone(crashpoint.Steps)
	if o.TwoHop {
		slots += r.hopSize()
		steps = append(steps, step.Relay...)
	}
	r.steps = steps
	plan := Plan(o.Seed, o.Duration, slots, o.Faults, steps)
	r.logf("run %s: %d consumers, %d events + %.0f%% re-sends at %.0f msg/s for %s, %d faults planned, files in %s",
		r.id, slots, distinct, o.DupRatio*100, o.Rate, o.Duration, len(plan), o.Dir)

	r.t0 = time.Now()
	if o.TwoHop {
		// The receipts fleet first: it declares the receipts stream.
		ho := o
		ho.Consumers = r.hopSize()
		hop, err := startConsumers(ho, "chaos-"+r.id+"-r", r.receiptsEnv, r.t0)
		if hop != nil {
			r.cleanups = append(r.cleanups, hop.KillAll)
		}
		if err != nil {
			return nil, err
		}
		r.hop = hop
	}
	fl, err := startConsumers(o, "chaos-"+r.id+"-c", r.paymentsEnv, r.t0)
	if fl != nil {
		r.cleanups = append(r.cleanups, fl.KillAll)
	}
	if err != nil {
		return nil, err
	}
	r.fleet = fl

	sctx, stopSampling := context.WithCancel(ctx)
	sampled := make(chan struct{})
	go func() { defer close(sampled); r.sample(sctx) }()
	defer func() { stopSampling(); <-sampled }()

	manifest := filepath.Join(o.Dir, "manifest.json")
	pub := exec.CommandContext(ctx, o.Bin, "publish", "--quiet", "--count", fmt.Sprint(distinct),
		"--users", fmt.Sprint(o.Users), "--dup-ratio", fmt.Sprint(o.DupRatio), "--delay-window", "2000",
		"--rate", fmt.Sprint(o.Rate), "--seed", fmt.Sprint(o.Seed), "--run", r.id, "--manifest", manifest)
	// The consumers' settings (their database records the partition count
	// the publisher checks), directly, on the publisher's node.
	pub.Env = append(append(os.Environ(), r.consumerEnv(r.direct())...), "AMQP_URL="+r.publishURL())
	pubLog, err := os.Create(filepath.Join(o.Dir, "publish.log"))
	if err != nil {
		return nil, err
	}
	defer pubLog.Close()
	pub.Stdout, pub.Stderr = pubLog, pubLog
	if err := pub.Start(); err != nil {
		return nil, fmt.Errorf("chaos: start publisher: %w", err)
	}
	published := make(chan error, 1)
	go func() { published <- pub.Wait() }()

	faulted := make(chan struct{})
	go func() { defer close(faulted); r.inject(ctx, plan) }()

	err = <-published
	r.published.Store(true)
	if err != nil {
		b, _ := os.ReadFile(pubLog.Name())
		<-faulted
		return nil, fmt.Errorf("chaos: idem publish: %v\n%s", err, b)
	}
	r.logf("stream published")
	<-faulted
	r.logf("fault schedule done; waiting up to %s for the fleet to settle", o.Settle)
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}

	m, err := loadgen.ReadManifest(manifest)
	if err != nil {
		return nil, err
	}
	res := &Result{Seed: o.Seed, RunID: r.id, Queue: r.queue, Consumers: o.Consumers, Duration: o.Duration.String(),
		Rate: o.Rate, Published: m.Messages, Distinct: len(m.Events), Planned: plan}
	if err := r.settle(ctx, m, r.forgiven()); err != nil {
		return nil, err
	}
	if r.fo != nil {
		if res.Failover, err = r.resend(ctx, m); err != nil {
			return nil, err
		}
	}
	res.NotDrained = r.fleet.stop(60 * time.Second)
	if r.hop != nil {
		res.NotDrained = append(res.NotDrained, r.hop.stop(60*time.Second)...)
	}
	r.logf("fleet stopped")
	// With no consumer left, whatever was unacked is back to ready: what
	// is in the queue now is stuck.
	if res.LeftInQueue, err = r.workDepth(); err != nil {
		return nil, err
	}
	stopSampling()
	<-sampled

	// Counts of consumers that exited cleanly are final; those of killed
	// ones are their last per-second snapshot.
	res.collect(r.fleet.Procs())
	if res.DeadLetterQueue, err = r.queueDepth(r.queue + ".dlq"); err != nil {
		return nil, err
	}
	if r.hop != nil {
		if err := r.judgeSecondHop(ctx, m, res); err != nil {
			return nil, err
		}
	}
	if res.Verify, err = verify.CheckShards(ctx, r.pools, m); err != nil {
		return nil, err
	}
	r.mu.Lock()
	res.Faults, res.Timeline = r.faults, r.timeline
	r.mu.Unlock()
	res.Crashes = r.fleet.crashRecords()
	res.Restarts = r.fleet.Restarts()
	if r.hop != nil {
		res.Crashes = append(res.Crashes, r.hop.crashRecords()...)
		res.Restarts += r.hop.Restarts()
	}
	res.Elapsed = time.Since(r.t0).Round(100 * time.Millisecond).String()
	res.judge()
	return res, nil
}

// startServices starts the run's Redis and Postgres (and, for a cluster
// run, its RabbitMQ cluster) and the links to them, and registers their
// removal, and the queue's.
func (r *run) startServices(ctx context.Context) error {
	rdir := filepath.Join(r.o.Dir, "redis")
	if err := os.MkdirAll(rdir, 0o755); err != nil {
		return err
	}
	var err error
	shards := 1
	if r.o.Cluster {
		shards = 2
		r.logf("starting a RabbitMQ cluster (3 nodes), a Redis Cluster (3 masters, 3 replicas) and %d PostgreSQL shards", shards)
		rabbit := sandbox.StartRabbitClusterAsync(3, 2*time.Minute)
		r.rcluster, err = sandbox.StartRedisCluster(rdir, 3)
		mq, mqErr := rabbit()
		if mq != nil {
			r.cleanups = append(r.cleanups, mq.Remove)
		}
		if r.rcluster != nil {
			r.cleanups = append(r.cleanups, r.rcluster.Kill)
		}
		if err := errors.Join(err, mqErr); err != nil {
			return fmt.Errorf("chaos: --cluster: %w", err)
		}
		r.rabbit = mq
		r.amqpURL = r.rabbit.URLs()
		r.pubNode = r.rabbit.Nodes[len(r.rabbit.Nodes)-1]
	} else {
		if r.redis, err = sandbox.StartRedis(rdir); err != nil {
			return err
		}
		r.cleanups = append(r.cleanups, r.redis.Kill)
		r.amqpURL = r.o.AMQPURL
	}
	for shard := range shards {
		var pg *sandbox.Postgres
		poolURL := ""
		if shard == 0 && slices.Contains(r.o.Faults, PGFailover) {
			pair, err := r.startPair()
			if err != nil {
				return err
			}
			r.cleanups = append(r.cleanups, pair.Remove)
			pg, poolURL = pair.Primary, pair.URL()
		} else {
			if pg, err = sandbox.StartPostgres(""); err != nil {
				return fmt.Errorf("chaos: the run needs a PostgreSQL of its own (to restart it): %w", err)
			}
			r.cleanups = append(r.cleanups, pg.Remove)
			poolURL = pg.URL()
		}
		pool, err := pgxpool.New(ctx, poolURL)
		if err != nil {
			return err
		}
		r.cleanups = append(r.cleanups, pool.Close)
		if _, err := payments.Migrate(ctx, pool); err != nil {
			return err
		}
		r.pgs, r.pools = append(r.pgs, pg), append(r.pools, pool)
	}
	if !r.o.Cluster {
		r.cleanups = append(r.cleanups, func() { _ = sandbox.DeleteQueue(r.o.AMQPURL, r.queue) })
		if r.o.TwoHop {
			for _, q := range r.receiptsTopology().Queues() {
				r.cleanups = append(r.cleanups, func() { _ = sandbox.DeleteQueue(r.o.AMQPURL, q) })
			}
		}
	}
	if r.o.TwoHop {
		if r.api, err = startAPI(1500 * time.Millisecond); err != nil {
			return err
		}
		r.cleanups = append(r.cleanups, r.api.close)
	}
	if slices.Contains(r.o.Faults, RelayCut) || slices.Contains(r.o.Faults, AMQPClose) {
		if err := r.startCuts(); err != nil {
			return err
		}
	}
	if err := r.startLinks(); err != nil {
		return err
	}
	r.inspect = sandbox.NewInspector(r.publishURL())
	r.cleanups = append(r.cleanups, r.inspect.Close)
	return nil
}

// startCuts puts an AMQPCut in front of each broker node, on the
// consumers' way to it (their links lead to it), for relay-cut and
// amqp-close.
func (r *run) startCuts() error {
	for _, u := range broker.SplitURLs(r.amqpURL) {
		addr, err := amqpAddr(u)
		if err != nil {
			return err
		}
		cut, err := sandbox.StartAMQPCut(addr)
		if err != nil {
			return err
		}
		r.cleanups = append(r.cleanups, cut.Close)
		r.cuts = append(r.cuts, cut)
	}
	return nil
}

// links are one consumer slot's ways to the run's services, each a fault
// link of its own, so that a fault can cut one consumer off or all of them.
type links struct {
	at    endpoints       // the services, through the links
	pg    []*sandbox.Link // one per shard
	redis *sandbox.Link   // nil in a --cluster run
	amqp  []*sandbox.Link // one per broker node, to its AMQPCut if it has one
	api   *sandbox.Link   // the second hop's API; nil without it
}

// endpoints are the URLs a process reaches the run's services at.
type endpoints struct {
	pg    []string // one per shard, with the run's application_name
	redis string
	amqp  string // one URL per broker node, comma-separated
	api   string // the second hop's API
}

// direct is where the services are: the publisher's way to them (and the
// links' upstreams).
func (r *run) direct() endpoints {
	var e endpoints
	for i, pg := range r.pgs {
		u := pg.URL()
		if i == 0 && r.fo != nil {
			u = r.fo.pair.URL() // the pair's front: the primary, whichever it is
		}
		e.pg = append(e.pg, sandbox.WithParam(u, "application_name", r.appName))
	}
	if r.rcluster != nil {
		e.redis = r.rcluster.URL()
	} else {
		e.redis = r.redis.URL()
	}
	e.amqp = r.amqpURL
	if r.api != nil {
		e.api = r.api.url
	}
	return e
}

// startLinks gives every consumer slot (the payments fleet's and the
// receipts fleet's) its links: to each Postgres shard, to Redis, to each
// broker node (through its AMQPCut, if any) and to the API. Everything the
// fleet dials goes through them: consume, dead-letter and relay
// connections, sessions, Redis clients, relays' POSTs. A --cluster run's
// Redis stays direct: a Redis Cluster client dials the nodes at the
// addresses they announce (CLUSTER SLOTS, MOVED), not the one it was
// given, so a link would carry its first call only.
func (r *run) startLinks() error {
	r.proxy = sandbox.StartFaults()
	r.cleanups = append(r.cleanups, r.proxy.Close)
	direct := r.direct()
	slots := r.o.Consumers
	if r.o.TwoHop {
		slots += r.hopSize()
	}
	for slot := range slots {
		l := &links{}
		link := func(name, rawURL, upstream string) (*sandbox.Link, string, error) {
			if upstream == "" {
				var err error
				if upstream, err = hostPort(rawURL); err != nil {
					return nil, "", fmt.Errorf("chaos: link to %s: %w", name, err)
				}
			}
			k, err := r.proxy.Link(fmt.Sprintf("slot%d-%s", slot, name), upstream)
			if err != nil {
				return nil, "", err
			}
			u, err := withHost(rawURL, k.Addr())
			return k, u, err
		}
		for i, u := range direct.pg {
			k, via, err := link(fmt.Sprintf("pg%d", i), u, "")
			if err != nil {
				return err
			}
			l.pg, l.at.pg = append(l.pg, k), append(l.at.pg, via)
		}
		l.at.redis = direct.redis
		if r.rcluster == nil {
			k, via, err := link("redis", direct.redis, "")
			if err != nil {
				return err
			}
			l.redis, l.at.redis = k, via
		}
		var amqpURLs []string
		for i, u := range broker.SplitURLs(direct.amqp) {
			upstream, err := amqpAddr(u)
			if err != nil {
				return err
			}
			if r.cuts != nil {
				upstream = r.cuts[i].Addr()
			}
			k, via, err := link(fmt.Sprintf("amqp%d", i), u, upstream)
			if err != nil {
				return err
			}
			l.amqp, amqpURLs = append(l.amqp, k), append(amqpURLs, via)
		}
		// Each slot dials a different node first, so that every node has
		// consumers and a rabbit-kill always cuts some.
		n := slot % len(amqpURLs)
		l.at.amqp = strings.Join(append(slices.Clone(amqpURLs[n:]), amqpURLs[:n]...), ",")
		if direct.api != "" {
			k, via, err := link("api", direct.api, "")
			if err != nil {
				return err
			}
			l.api, l.at.api = k, via
		}
		r.links = append(r.links, l)
	}
	return nil
}

// hostPort is the host:port a URL names.
func hostPort(rawURL string) (string, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "", err
	}
	if u.Port() == "" {
		return "", fmt.Errorf("%s names no port", u.Redacted())
	}
	return u.Host, nil
}

// amqpAddr is the host:port an AMQP URL names (5672 or 5671 if it names
// none).
func amqpAddr(rawURL string) (string, error) {
	uri, err := amqp.ParseURI(rawURL)
	if err != nil {
		return "", fmt.Errorf("chaos: AMQP_URL: %w", err)
	}
	return net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port)), nil
}

// withHost is rawURL with its host:port replaced by addr.
func withHost(rawURL, addr string) (string, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "", err
	}
	u.Host = addr
	return u.String(), nil
}

// publishURL is where the publisher and the queue inspector connect: the
// shared broker, or the one node of the run's cluster that is never stopped.
func (r *run) publishURL() string {
	if r.pubNode != nil {
		return r.pubNode.URL()
	}
	return r.o.AMQPURL
}

// consumerEnv is the env of a consumer that reaches the services at e.
func (r *run) consumerEnv(e endpoints) []string {
	env := []string{
		"DATABASE_URL=" + e.pg[0],
		"AMQP_URL=" + e.amqp,
		"REDIS_URL=" + e.redis,
		"IDEM_QUEUE=" + r.queue,
		fmt.Sprintf("IDEM_PARTITIONS=%d", max(1, r.o.Partitions)), // as the publisher's
	}
	if !r.o.Cluster {
		return env
	}
	return append(env,
		"IDEM_REDIS_MODE=cluster",
		"IDEM_POSTGRES_SHARDS="+strings.Join(e.pg, " "),
	)
}

// workQueues are the run's work queues: one, or one per partition (and
// the receipts stream's, in a two-hop run).
func (r *run) workQueues() []string {
	qs := broker.Topology{Queue: r.queue, Partitions: r.o.Partitions}.Queues()
	if r.o.TwoHop {
		qs = append(qs, r.receiptsTopology().Queues()...)
	}
	return qs
}

// workDepth is the ready messages of every work queue.
func (r *run) workDepth() (int, error) {
	total := 0
	for _, q := range r.workQueues() {
		n, err := r.queueDepth(q)
		if err != nil {
			return 0, err
		}
		total += n
	}
	return total, nil
}

// effects counts the ledger rows of every shard, or -1 if one does not answer.
func (r *run) effects(ctx context.Context) int64 {
	var total int64
	for _, pool := range r.pools {
		var n int64
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM payments_ledger`).Scan(&n); err != nil {
			return -1
		}
		total += n
	}
	return total
}

// settle waits until every event is applied, no message is ready in the
// queue and no consumer holds one unacked (twice in a row, the consumers'
// stats files being up to a second old), or a double shows, or Settle
// passes; the verdict is taken after the fleet stops. A delivery still held
// (a duplicate retried in place while Postgres restarts, say) would be
// handed back by the stop and counted as stuck.
func (r *run) settle(ctx context.Context, m loadgen.Manifest, forgive map[string]bool) error {
	deadline := time.Now().Add(r.o.Settle)
	quietSince := time.Time{}
	for time.Now().Before(deadline) {
		rep, err := verify.CheckShards(ctx, r.pools, m)
		if err == nil && rep.Doubled > 0 {
			return nil
		}
		if err == nil && r.onlyForgiven(ctx, m, rep.Missing, forgive) && (r.hop == nil || r.hopSettled(ctx, m, forgive)) {
			left, err := r.workDepth()
			if err != nil {
				return err
			}
			switch {
			case left > 0 || r.unacked() > 0:
				quietSince = time.Time{}
			case quietSince.IsZero():
				quietSince = time.Now()
			case time.Since(quietSince) >= 1500*time.Millisecond:
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
	r.logf("the fleet did not settle within %s", r.o.Settle)
	return nil
}

// onlyForgiven reports whether the missing payments, n of them, are all
// in forgive (see forgiven).
func (r *run) onlyForgiven(ctx context.Context, m loadgen.Manifest, n int, forgive map[string]bool) bool {
	if n == 0 {
		return true
	}
	if n > len(forgive) {
		return false
	}
	missing, err := r.missingPayments(ctx, m)
	if err != nil {
		return false
	}
	for _, id := range missing {
		if !forgive[id] {
			return false
		}
	}
	return true
}

// unacked sums the deliveries the running consumers hold unacked, as their
// stats files last said.
func (r *run) unacked() int64 {
	var n int64
	procs := r.fleet.Procs()
	if r.hop != nil {
		procs = append(procs, r.hop.Procs()...)
	}
	for _, p := range procs {
		select {
		case <-p.Done():
			continue // its deliveries went back to the queue when it died
		default:
		}
		if st, err := p.Stats(); err == nil {
			n += st[telemetry.GaugeUnacked]
		}
	}
	return n
}

// queueDepth is the ready messages of a queue; 0 if it does not exist.
func (r *run) queueDepth(queue string) (int, error) {
	n, err := r.inspect.Ready(queue)
	if errors.Is(err, sandbox.ErrNoQueue) {
		return 0, nil
	}
	return n, err
}
