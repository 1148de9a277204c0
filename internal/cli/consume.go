package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/internal/config"
	"github.com/idemhq/idem/internal/crashpoint"
	"github.com/idemhq/idem/internal/fleet"
	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/telemetry"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/guard/redistier"
	"github.com/idemhq/idem/pkg/metrics"
)

func runConsume(ctx context.Context, e *env, args []string) error {
	fs := newFlags(e, "consume", "Consumes the queue until SIGTERM or SIGINT, then drains: in-flight and\nprefetched events finish and are acked. Run any number of these\nprocesses on one queue. Applies pending migrations at start.")
	path := fs.String("config", "", "YAML config `file`")
	host, _ := os.Hostname()
	name := fs.String("name", fmt.Sprintf("idem-consume-%s-%d", host, os.Getpid()), "client-provided RabbitMQ connection `name`")
	statsFile := fs.String("stats-file", "", "write the outcome counts as JSON to this `file` every second and on exit")
	noMigrate := fs.Bool("no-migrate", false, "do not apply pending migrations at start")
	only := fs.String("partition", "", "consume only these partitions (`K[,K…]`, of 0 to partitions-1); default: all")
	if err := parse(fs, args); err != nil {
		return err
	}
	partitions, err := parsePartitions(*only)
	if err != nil {
		fmt.Fprintf(e.stderr, "idem consume: --partition: %v\n", err)
		return ErrUsage
	}
	cfg, log, dbs, err := e.loadDB(ctx, *path)
	if err != nil {
		return err
	}
	defer dbs.Close()
	for _, p := range partitions {
		if p >= cfg.Partitions {
			return fmt.Errorf("--partition %d: the stream has %d partition(s), 0 to %d (the partitions setting, IDEM_PARTITIONS)", p, cfg.Partitions, cfg.Partitions-1)
		}
	}
	tuneGC(e.getenv)
	crash, err := crashpoint.Hook(e.getenv)
	if err != nil {
		return err
	}
	log = log.With("consumer", *name)

	// Metrics and probes answer from the start, while start-up waits.
	reg := telemetry.NewRegistry()
	m, err := metrics.New(reg)
	if err != nil {
		return err
	}
	m.AddReasons(payments.Reasons()...)
	var running atomic.Pointer[consumer.Consumer[payments.Event]] // set once it exists
	stats := func() consumer.Stats {
		if c := running.Load(); c != nil {
			return c.Stats()
		}
		return consumer.Stats{Prefetch: cfg.Consumer.Prefetch}
	}
	if err := m.WatchConsumer(stats); err != nil {
		return err
	}
	var fastRedis atomic.Value // the redis.UniversalClient buildGuard opens when the fast tier is on
	rdb := func() redis.UniversalClient { c, _ := fastRedis.Load().(redis.UniversalClient); return c }
	if cfg.MetricsAddr != "" {
		ln, err := telemetry.Listen(cfg.MetricsAddr)
		if err != nil {
			return err
		}
		h := telemetry.Handler(reg, readiness(dbs, stats, rdb))
		serveCtx, stopServing := context.WithCancel(context.WithoutCancel(ctx))
		served := make(chan struct{})
		go func() {
			defer close(served)
			if err := telemetry.Serve(serveCtx, ln, h); err != nil {
				log.Error("metrics server", "err", err)
			}
		}()
		// Served until the drain is over, so that a scrape sees the end.
		defer func() { stopServing(); <-served }()
	}

	// Start-up: wait (bounded, logged) for a Postgres that is not up yet;
	// stop at once on what cannot fix itself.
	startup := cfg.Consumer.StartupTimeout
	stores := make([]*pgtier.Store, len(dbs))
	var notBefore time.Time
	formerPartitions := 0
	for i, pool := range dbs {
		stores[i] = pgtier.New(pool)
		what := func(s string) string {
			if name := dbs.name(i); name != "" {
				return s + " on " + name
			}
			return s
		}
		if !*noMigrate {
			err := waitPostgres(ctx, startup, what("migrations"), log, func(ctx context.Context) error {
				ran, err := payments.Migrate(ctx, pool)
				for _, m := range ran {
					log.Info("applied migration", "version", m.Version, "name", m.Name, "shard", i)
				}
				return err
			})
			if err != nil {
				return startErr(ctx, err)
			}
		}
		// A shard must hold the keys the list routes to it.
		err := waitPostgres(ctx, startup, what("checking the shard's place (postgres.shards)"), log, func(ctx context.Context) error {
			return stores[i].CheckShard(ctx, i, len(dbs))
		})
		if err != nil {
			return startErr(ctx, err)
		}
		// Publishers and consumers must split the stream alike.
		err = waitPostgres(ctx, startup, what("checking the stream's partition count (partitions)"), log, func(ctx context.Context) error {
			l, err := stores[i].CheckPartitions(ctx, cfg.Queue, cfg.Partitions)
			formerPartitions = max(formerPartitions, l.Previous)
			return err
		})
		if err != nil {
			return startErr(ctx, err)
		}
		// Record the retention we enforce, so that prune cannot cut below
		// it, and learn where an earlier prune cut.
		var horizon pgtier.Horizon
		err = waitPostgres(ctx, startup, what("recording the retention in idem_horizon (run 'idem migrate' if the table is missing)"), log, func(ctx context.Context) (err error) {
			horizon, err = stores[i].EnforceRetention(ctx, cfg.Postgres.Retention, cfg.Consumer.ClockSkew)
			return err
		})
		if err != nil {
			return startErr(ctx, err)
		}
		if !horizon.PrunedThrough.IsZero() {
			notBefore = maxTime(notBefore, horizon.PrunedThrough.Add(horizon.ClockSkew))
		}
	}

	g, closeGuard, err := buildGuard(ctx, cfg, log, guardStores(stores), m, crash, func(c redis.UniversalClient) { fastRedis.Store(c) })
	if err != nil {
		return err
	}
	defer closeGuard()
	ccfg := consumerConfig(cfg, *name, log, m, crash)
	ccfg.Only = partitions
	ccfg.NotBefore = notBefore
	ccfg.FormerPartitions = formerPartitions
	c, err := consumer.New(ccfg, g, payments.Handler{})
	if err != nil {
		return err
	}
	running.Store(c)
	snapshot := func() any {
		snap, err := telemetry.Snapshot(reg)
		if err != nil {
			log.Error("read metrics", "err", err)
		}
		return snap
	}
	stopStats := func() {}
	if *statsFile != "" {
		// Every second, so that a consumer killed with SIGKILL leaves
		// counts at most a second old (idem chaos sums them).
		stopStats = fleet.WriteStatsEvery(*statsFile, time.Second, snapshot,
			func(err error) { log.Error("write stats file", "err", err) })
	}
	var pruning sync.WaitGroup
	if every := cfg.Postgres.PruneInterval; every > 0 {
		pctx, stopPruning := context.WithCancel(ctx)
		defer func() { stopPruning(); pruning.Wait() }()
		for i, store := range stores {
			pruning.Go(func() { pruneEvery(pctx, every, cfg, store, m, log.With("shard", i)) })
		}
	}
	err = c.Run(ctx)
	log.Info("stopped", "outcomes", snapshot())
	stopStats()
	if errors.Is(err, consumer.ErrBrokerRefused) || errors.Is(err, consumer.ErrBrokerUnreachable) {
		return fmt.Errorf("amqp_url: %w", err)
	}
	return err
}

// parsePartitions reads --partition's comma-separated list; the config's
// partitions setting bounds it later (consumer.Config.Only).
func parsePartitions(s string) ([]int, error) {
	var out []int
	for f := range strings.SplitSeq(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		p, err := strconv.Atoi(f)
		if err != nil || p < 0 {
			return nil, fmt.Errorf("%q is not a partition number", f)
		}
		out = append(out, p)
	}
	return out, nil
}

// readiness is what /readyz checks: the consumer consumes and Postgres
// answers. Redis is reported but not required: without it every event goes
// to Postgres, correctly.
func readiness(dbs shards, stats func() consumer.Stats, rdb func() redis.UniversalClient) []telemetry.Check {
	return []telemetry.Check{
		{Name: "consumer", Required: true, Run: func(context.Context) error {
			if !stats().Consuming {
				return errors.New("not consuming (starting, or reconnecting to RabbitMQ)")
			}
			return nil
		}},
		{Name: "postgres", Required: true, Run: func(ctx context.Context) error {
			// Every shard: a batch for a shard that is down is held.
			for i, pool := range dbs {
				if err := pool.Ping(ctx); err != nil {
					if name := dbs.name(i); name != "" {
						return fmt.Errorf("%s: %w", name, err)
					}
					return err
				}
			}
			return nil
		}},
		{Name: "rabbitmq_publishing", Run: func(context.Context) error {
			// Reported, not required: acks go on while the broker blocks
			// publishing; only dead letters wait.
			if why := stats().Blocked; why != "" {
				return fmt.Errorf("blocked by the broker (%s): dead letters wait, acks go on", why)
			}
			return nil
		}},
		{Name: "stranded", Run: func(context.Context) error {
			// Reported, not required: this consumer's queues are served.
			if s := stats(); s.Stranded > 0 {
				return fmt.Errorf("%d message(s) in %s, which nobody consumes (a publisher uses another partition count)", s.Stranded, strings.Join(s.StrandedIn, ", "))
			}
			return nil
		}},
		{Name: "redis", Run: func(ctx context.Context) error {
			c := rdb()
			if c == nil {
				return errors.New("not in use (redis.enabled is false, or not connected yet)")
			}
			return c.Ping(ctx).Err()
		}},
	}
}

// pruneBatch is the rows each of pruneEvery's DELETEs removes.
const pruneBatch = 10000

// pruneEvery runs idem prune's deletion every interval until ctx ends. Every
// consumer of a fleet may run it: prunes serialise on idem_horizon and
// delete disjoint rows.
func pruneEvery(ctx context.Context, every time.Duration, cfg config.Config, store *pgtier.Store, m *metrics.Metrics, log *slog.Logger) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n, cutoff, err := store.Prune(ctx, pgtier.PruneConfig{
			Retention: cfg.Postgres.Retention, ClockSkew: cfg.Consumer.ClockSkew, Batch: pruneBatch})
		m.Pruned(n)
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			log.Error("prune", "err", err, "rows", n)
		default:
			log.Info("pruned", "rows", n, "processed_before", cutoff.UTC().Format(time.RFC3339))
		}
	}
}

// guardStores is the guard's view of the shards' stores.
func guardStores(stores []*pgtier.Store) []guard.Store {
	out := make([]guard.Store, len(stores))
	for i, s := range stores {
		out[i] = s
	}
	return out
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// buildGuard wires the guard as cfg says: the store (or the shards), and the Redis tier when
// enabled (checked at start, breaker transitions logged and counted). onRedis,
// if set, sees the Redis client first (to add a hook). The returned func
// writes the last done markers and closes Redis.
func buildGuard(ctx context.Context, cfg config.Config, log *slog.Logger, stores []guard.Store, m *metrics.Metrics,
	hook func(context.Context, guard.Step), onRedis func(redis.UniversalClient)) (*guard.Guard, func(), error) {
	gcfg := guard.Config{Scope: cfg.Scope, Hook: hook, Observer: m, Logger: log}
	if len(stores) == 1 {
		gcfg.Store = stores[0]
	} else {
		gcfg.Shards = stores
	}
	closeRedis := func() {}
	if cfg.Redis.Enabled {
		rdb, err := cfg.RedisClient()
		if err != nil {
			return nil, nil, err
		}
		if onRedis != nil {
			onRedis(rdb)
		}
		if err := checkRedis(ctx, rdb, log); err != nil {
			rdb.Close()
			return nil, nil, err
		}
		fast, err := redistier.New(rdb, redisTierConfig(cfg, log, m))
		if err != nil {
			rdb.Close()
			return nil, nil, err
		}
		gcfg.Fast = fast
		closeRedis = func() { rdb.Close() }
	}
	g, err := guard.New(gcfg)
	if err != nil {
		closeRedis()
		return nil, nil, err
	}
	return g, func() {
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		_ = g.Flush(fctx) // best effort: a lost marker costs one trip to Postgres
		closeRedis()
	}, nil
}

// consumerGCPercent is the garbage collector's target for consumers: their
// live heap is a few MiB, so collecting at 4× it trades a few tens of MiB for
// a good share of the CPU the collector would take at the default 100.
const consumerGCPercent = 400

// tuneGC sets consumerGCPercent unless GOGC is set.
func tuneGC(getenv func(string) string) {
	if getenv("GOGC") == "" {
		debug.SetGCPercent(consumerGCPercent)
	}
}

// startErr is err, or nil if a signal ended start-up: stopping before
// consuming anything is a clean exit.
func startErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// checkRedis refuses a Redis too old for the fast tier. A Redis that does
// not answer is only logged: the breaker routes around it until it does.
func checkRedis(ctx context.Context, rdb redis.UniversalClient, log *slog.Logger) error {
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	err := redistier.CheckServer(cctx, rdb)
	switch {
	case errors.Is(err, redistier.ErrRedisTooOld):
		return fmt.Errorf("redis_url: %w (or set redis.enabled=false to run on Postgres alone)", err)
	case err != nil:
		log.Warn("redis not answering at start; events go to Postgres until it does", "err", err)
	}
	return nil
}

func redisTierConfig(cfg config.Config, log *slog.Logger, m *metrics.Metrics) redistier.Config {
	return redistier.Config{
		Prefix:  cfg.Redis.Prefix,
		Lease:   cfg.Redis.Lease,
		DoneTTL: cfg.Redis.DoneTTL,
		Timeout: cfg.Redis.Timeout,
		Breaker: redistier.BreakerConfig{
			FailureThreshold: cfg.Redis.BreakerFailures,
			MinOutage:        cfg.Redis.BreakerMinOutage,
			OpenTimeout:      cfg.Redis.BreakerOpenTimeout,
			HalfOpenRequests: cfg.Redis.BreakerHalfOpenRequests,
			OnStateChange: func(from, to string) {
				log.Warn("redis circuit breaker", "from", from, "to", to)
				m.BreakerChanged(from, to)
			},
		},
	}
}

func consumerConfig(cfg config.Config, name string, log *slog.Logger, obs consumer.Observer, hook func(context.Context, guard.Step)) consumer.Config {
	return consumer.Config{
		URL:                 cfg.AMQPURL,
		Queue:               cfg.Queue,
		Partitions:          cfg.Partitions,
		ConnectionName:      name,
		Prefetch:            cfg.Consumer.Prefetch,
		Workers:             cfg.Consumer.Workers,
		BatchSize:           cfg.Consumer.BatchSize,
		BatchLinger:         cfg.Consumer.BatchLinger,
		KeyOrder:            cfg.Consumer.KeyOrder,
		DeliveryLimit:       cfg.Consumer.DeliveryLimit,
		BrokerDeliveryLimit: cfg.Consumer.BrokerDeliveryLimit,
		HandlerTimeout:      cfg.Consumer.HandlerTimeout,
		Retention:           cfg.Postgres.Retention,
		ClockSkew:           cfg.Consumer.ClockSkew,
		Untimed:             consumer.UntimedPolicy(cfg.Consumer.Untimed),
		StoreHold:           cfg.Consumer.StoreHold,
		StartupTimeout:      cfg.Consumer.StartupTimeout,
		RetryBackoff:        consumer.Backoff{Min: cfg.Consumer.RetryBackoffMin, Max: cfg.Consumer.RetryBackoffMax},
		ReconnectBackoff:    consumer.Backoff{Min: cfg.Consumer.ReconnectBackoffMin, Max: cfg.Consumer.ReconnectBackoffMax},
		DrainTimeout:        cfg.Consumer.DrainTimeout,
		ConfirmTimeout:      cfg.Consumer.ConfirmTimeout,
		Hook:                hook,
		Observer:            obs,
		Logger:              log,
	}
}
