package idem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/internal/clientlog"
	"github.com/idemhq/idem/internal/heartbeat"
	"github.com/idemhq/idem/internal/horizon"
	"github.com/idemhq/idem/internal/layout"
	"github.com/idemhq/idem/internal/pgerr"
	"github.com/idemhq/idem/internal/pgsession"
	"github.com/idemhq/idem/internal/replication"
	"github.com/idemhq/idem/migrations"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/guard/redistier"
	"github.com/idemhq/idem/pkg/metrics"
	"github.com/idemhq/idem/pkg/outbox"
)

// Service runs one handler on one stream. Create it with New, run it with
// Run; Health and Stats are safe to call at any time.
type Service[T any] struct {
	cfg     Config
	handler consumer.Handler[T]
	log     *slog.Logger
	metrics *metrics.Metrics // nil without Config.Metrics

	dbs     []*pgxpool.Pool
	ownDBs  bool
	stores  []*pgtier.Store
	repl    *replication.Watcher  // each shard's standbys, for the log, /readyz and metrics
	rdb     redis.UniversalClient // nil: Postgres alone
	ownRDB  bool
	fast    *redistier.Filter
	running atomic.Pointer[consumer.Consumer[T]]

	outcomes heartbeat.Counter // every settlement's outcome, for the heartbeat

	relay        *outbox.Relay   // nil: no relay in this service
	destinations map[string]bool // Config.Outbox's names; nil: Enqueue checks none
}

// New checks cfg and returns a Service that runs h. It opens no connection:
// a pool opened from DatabaseURL and a client opened from RedisURL connect
// on first use, in Run.
func New[T any](cfg Config, h consumer.Handler[T]) (*Service[T], error) {
	if h == nil {
		return nil, errors.New("idem: a handler is required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	clientlog.Route(cfg.Logger)
	if cfg.Consumer.Logger == nil {
		cfg.Consumer.Logger = cfg.Logger
	}
	cfg.Consumer = cfg.Consumer.WithDefaults()
	cfg.Fast = cfg.Fast.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	for i, p := range cfg.Databases {
		if n := int(p.Config().MaxConns); n <= cfg.Consumer.Workers {
			cfg.Logger.Warn("a database pool is smaller than the workers: batches will wait for a connection",
				"shard", i, "max_conns", n, "workers", cfg.Consumer.Workers)
		}
	}
	s := &Service[T]{cfg: cfg, handler: h, log: cfg.Logger}
	if err := s.open(); err != nil {
		s.close()
		return nil, err
	}
	if err := s.openRelay(); err != nil {
		s.close()
		return nil, err
	}
	s.warnLinks()
	for _, part := range s.cfg.HistoryWithout {
		s.log.Warn("the database's history leaves out "+part+" (HistoryWithout, postgres.history_without): a done marker in Redis is not checked against "+
			pgtier.HistoryParts[part]+"; an event lost that way and re-sent while Redis holds its marker is dropped as a duplicate", "part", part)
	}
	// Build once, so that every bad setting is New's error, not Run's.
	if _, _, err := s.build(time.Time{}, 0); err != nil {
		s.close()
		return nil, err
	}
	return s, nil
}

// open creates the pools, stores, Redis client, fast tier and metrics.
func (s *Service[T]) open() error {
	cfg := &s.cfg
	s.dbs = cfg.Databases
	if cfg.DatabaseURL != "" {
		pc, err := pgxpool.ParseConfig(cfg.DatabaseURL)
		if err != nil {
			return fmt.Errorf("idem: DatabaseURL: %w", err)
		}
		if !hasParam(cfg.DatabaseURL, "pool_max_conns") {
			pc.MaxConns = int32(cfg.Consumer.Workers+4) + cfg.relayConns()
		}
		if t := pc.ConnConfig.ConnectTimeout; t == 0 || t > 5*time.Second {
			pc.ConnConfig.ConnectTimeout = 5 * time.Second
		}
		// Sessions bounded on both ends: an orphaned one never holds a
		// claimed row's lock past the handler timeout (or a relay pass's
		// bound) and a margin.
		pgsession.Apply(pc, pgsession.Bounds{Tx: max(cfg.Consumer.HandlerTimeout, cfg.relayTx())})
		pool, err := pgxpool.NewWithConfig(context.Background(), pc)
		if err != nil {
			return fmt.Errorf("idem: DatabaseURL: %w", err)
		}
		s.dbs, s.ownDBs = []*pgxpool.Pool{pool}, true
	}
	dbs := make([]replication.Querier, len(s.dbs))
	for i, p := range s.dbs {
		// Without Redis no done marker is written or trusted: the claims
		// need not read the database's history.
		noMarkers := cfg.Redis == nil && cfg.RedisURL == ""
		st, err := pgtier.NewWith(p, pgtier.Options{HistoryWithout: cfg.HistoryWithout, NoMarkers: noMarkers})
		if err != nil {
			return fmt.Errorf("idem: HistoryWithout: %w", err)
		}
		s.stores = append(s.stores, st)
		dbs[i] = p
	}
	s.repl = replication.NewWatcher(dbs, s.log)
	if cfg.Metrics != nil {
		m, err := metrics.New(cfg.Metrics)
		if err != nil {
			return fmt.Errorf("idem: Metrics: %w", err)
		}
		if r, ok := s.handler.(interface{ Reasons() []string }); ok {
			m.AddReasons(r.Reasons()...)
		}
		if err := m.WatchConsumer(s.Stats); err != nil {
			return fmt.Errorf("idem: Metrics: %w", err)
		}
		if err := cfg.Metrics.Register(s.repl.Collector()); err != nil {
			return fmt.Errorf("idem: Metrics: %w", err)
		}
		s.metrics = m
	}
	s.rdb = cfg.Redis
	if cfg.RedisURL != "" {
		o, err := redisOptions(cfg.RedisURL, cfg.RedisTLS)
		if err != nil {
			return err
		}
		s.rdb, s.ownRDB = redis.NewClient(o), true
	}
	if s.rdb != nil {
		fc := cfg.Fast
		user := fc.Breaker.OnStateChange
		fc.Breaker.OnStateChange = func(from, to string) {
			s.log.Warn("redis circuit breaker", "from", from, "to", to)
			if s.metrics != nil {
				s.metrics.BreakerChanged(from, to)
			}
			if user != nil {
				user(from, to)
			}
		}
		f, err := redistier.New(s.rdb, fc)
		if err != nil {
			return fmt.Errorf("idem: %w", err)
		}
		s.fast = f
	}
	return nil
}

// build returns the guard and the consumer, refusing events before
// notBefore and watching the queues of a former partition count.
func (s *Service[T]) build(notBefore time.Time, formerPartitions int) (*consumer.Consumer[T], *guard.Guard, error) {
	gcfg := guard.Config{Scope: s.cfg.Scope, Logger: s.log}
	if len(s.stores) == 1 {
		gcfg.Store = s.stores[0]
	} else {
		for _, st := range s.stores {
			gcfg.Shards = append(gcfg.Shards, st)
		}
	}
	if s.fast != nil {
		gcfg.Fast = s.fast
	}
	ccfg := s.cfg.Consumer
	var obs consumer.Observer = counting{&s.outcomes}
	if ccfg.Observer != nil {
		obs = observers{obs, ccfg.Observer}
	}
	if s.metrics != nil {
		gcfg.Observer = s.metrics
		obs = observers{s.metrics, obs}
	}
	ccfg.Observer = obs
	g, err := guard.New(gcfg)
	if err != nil {
		return nil, nil, fmt.Errorf("idem: %w", err)
	}
	ccfg.NotBefore, ccfg.FormerPartitions = notBefore, formerPartitions
	c, err := consumer.New(ccfg, g, s.handler)
	if err != nil {
		return nil, nil, fmt.Errorf("idem: %w", err)
	}
	return c, g, nil
}

// Run starts up, consumes until ctx ends, drains and closes what New
// opened. Start-up waits, logging, for a PostgreSQL that is not up yet (up
// to Consumer.StartupTimeout) and stops at once on what cannot fix itself:
// a failing migration, migrations not applied (without Migrate), a database
// in another shard's place, another partition count, a Redis too old for
// the fast tier or lacking the database number it is given, and RabbitMQ
// refusing the connection again and again (consumer.ErrBrokerRefused; once the
// consumer has consumed, a refusal is retried for as long as it lasts, and
// Health says so). A Redis that does not answer is logged; events go to
// Postgres until it does. With Config.Outbox, the relay runs beside the
// consumer from the end of start-up until the consumer has drained; a
// queue destination whose partition count differs from its stream's stops
// the service. Run returns nil when ctx ends, even during start-up. Call
// it once.
func (s *Service[T]) Run(ctx context.Context) error {
	defer s.close()
	notBefore, former, err := s.startUp(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	c, g, err := s.build(notBefore, former)
	if err != nil {
		return err
	}
	s.running.Store(c)
	cctx, stopRelay := s.startRelay(ctx)
	var pruning sync.WaitGroup
	if every := s.cfg.PruneInterval; every > 0 {
		pctx, stop := context.WithCancel(ctx)
		defer func() { stop(); pruning.Wait() }()
		for i, db := range s.dbs {
			pruning.Go(func() { s.pruneEvery(pctx, every, db, s.log.With("shard", i)) })
		}
	}
	// Whether an acked event survives a failover: read now and every
	// replication.Every, logged when it changes.
	rctx, stopWatching := context.WithCancel(ctx)
	var watching sync.WaitGroup
	watching.Go(func() { s.repl.Run(rctx, replication.Every) })
	if s.cfg.Heartbeat >= 0 {
		watching.Go(func() {
			heartbeat.Run(rctx, s.dbs[0], heartbeat.Instance(s.cfg.Consumer.ConnectionName), s.cfg.Heartbeat, s.report, s.log)
		})
	}
	defer func() { stopWatching(); watching.Wait() }()
	err = c.Run(cctx)
	if rerr := stopRelay(); rerr != nil && err == nil {
		err = rerr
	}
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	_ = g.Flush(fctx) // best effort: a lost marker costs one trip to Postgres
	cancel()
	return err
}

// warnUnbound logs, for a pool behind a transaction-mode pooler, the
// session bounds nothing sets on its server sessions (Apply sets none
// there) and the ALTER ROLE statements that would.
func (s *Service[T]) warnUnbound(ctx context.Context, pool *pgxpool.Pool, shard int) {
	bounds := pgsession.Bounds{Tx: max(s.cfg.Consumer.HandlerTimeout, s.cfg.relayTx())}
	unset, role, err := pgsession.UnsetBounds(ctx, pool, bounds)
	if err != nil || len(unset) == 0 {
		return
	}
	var set []string
	for _, n := range unset {
		set = append(set, fmt.Sprintf("ALTER ROLE %s SET %s = '%sms'", role, n, bounds.Params()[n]))
	}
	s.log.Warn("PostgreSQL is reached through a transaction-mode pooler, where idem sets no session setting, and nothing sets "+
		strings.Join(unset, ", ")+": a session orphaned mid-transaction holds its row locks until the pooler notices. Set them on the role: "+
		strings.Join(set, "; "), "shard", shard)
}

// startUp runs the checks and records of Run's start, and returns where
// the earliest event the consumer may take lies and the stream's former
// partition count.
func (s *Service[T]) startUp(ctx context.Context) (notBefore time.Time, former int, err error) {
	cc := s.cfg.Consumer
	for i, pool := range s.dbs {
		what := func(w string) string {
			if len(s.dbs) > 1 {
				return fmt.Sprintf("%s on shard %d", w, i)
			}
			return w
		}
		wait := func(w string, fn func(context.Context) error) error {
			return pgerr.Wait(ctx, cc.StartupTimeout, what(w), s.log, fn)
		}
		// Behind a transaction-mode pooler: a pool of the service's own must
		// not prepare named statements (said now, not as every claim's
		// 26000 or 42P05; idem's own pools adapt, see pgsession.Apply), and
		// the role must set the session bounds idem sets nowhere there.
		// A pool idem fitted (pgsession.Apply) probed at its first
		// connection, which NamedStatements makes; another is probed here.
		named := pgsession.NamedStatements(ctx, pool)
		pooled, known := pgsession.Known(pool)
		if !known {
			if err := wait("probing for a transaction pooler", func(ctx context.Context) (err error) {
				pooled, err = pgsession.PoolIsPooled(ctx, pool)
				return err
			}); err != nil {
				return notBefore, 0, err
			}
		}
		if pooled && named {
			return notBefore, 0, fmt.Errorf("idem: %s: %w (in pgx: ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe)",
				what("Databases"), pgsession.ErrPooledStatements)
		}
		if pooled {
			s.warnUnbound(ctx, pool, i)
		}
		if s.cfg.Migrate {
			err := wait("migrations", func(ctx context.Context) error {
				for _, set := range append([]migrations.Set{migrations.Guard}, s.cfg.Migrations...) {
					ran, err := migrations.ApplySet(ctx, pool, set)
					for _, m := range ran {
						s.log.Info("applied migration", "set", set.Ledger, "version", m.Version, "name", m.Name, "shard", i)
					}
					if err != nil {
						return err
					}
				}
				return nil
			})
			if err != nil {
				return notBefore, 0, err
			}
		} else {
			// Forgotten migrations are said as such, not as a table
			// missing in the next check.
			var missing *layout.UnmigratedError
			if err := wait("checking the migrations", func(ctx context.Context) error {
				err := layout.CheckMigrated(ctx, pool, append([]migrations.Set{migrations.Guard}, s.cfg.Migrations...)...)
				if errors.As(err, &missing) {
					return nil // not the database's fault: no retry
				}
				return err
			}); err != nil {
				return notBefore, 0, err
			}
			if missing != nil {
				remedy := "run `idem migrate`, or set Migrate in idem.Config"
				if !missing.Own() {
					remedy = "apply them, or set Migrate in idem.Config"
				}
				return notBefore, 0, fmt.Errorf("idem: %s: %w: %s", what("database"), missing, remedy)
			}
		}
		// The service's own check, once its tables are in place.
		if check := s.cfg.CheckReady; check != nil {
			if err := wait("the service's CheckReady", func(ctx context.Context) error {
				return check(ctx, i, pool)
			}); err != nil {
				return notBefore, 0, fmt.Errorf("idem: CheckReady on %s: %w", what("the database"), err)
			}
		}
		// A shard must hold the keys the list routes to it.
		if err := wait("checking the shard's place", func(ctx context.Context) error {
			return layout.CheckShard(ctx, pool, i, len(s.dbs))
		}); err != nil {
			return notBefore, 0, err
		}
		// Every claim calls these: a role or engine without them is a
		// setting to fix, said now, not a failure of every event.
		if err := wait("checking the calls the guard's claims make", func(ctx context.Context) error {
			return layout.CheckGuardCalls(ctx, pool, s.stores[i].History, s.cfg.HistoryWithout...)
		}); err != nil {
			return notBefore, 0, fmt.Errorf("idem: %s: %w", what("database"), err)
		}
		// Publishers and consumers must split the stream alike.
		if err := wait("checking the stream's partition count", func(ctx context.Context) error {
			l, err := layout.CheckPartitions(ctx, pool, cc.Queue, max(cc.Partitions, 1))
			former = max(former, l.Previous)
			return err
		}); err != nil {
			return notBefore, 0, err
		}
		// Record the retention and skew the claim enforces, so that prune
		// cannot cut below them, and learn where an earlier prune cut.
		var h horizon.Record
		if err := wait("recording the retention in idem_horizon", func(ctx context.Context) (err error) {
			h, err = horizon.Enforce(ctx, pool, cc.Retention, cc.ClockSkew)
			return err
		}); err != nil {
			return notBefore, 0, err
		}
		if !h.PrunedThrough.IsZero() {
			if t := h.PrunedThrough.Add(h.ClockSkew); t.After(notBefore) {
				notBefore = t
			}
		}
	}
	if s.rdb != nil {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := redistier.CheckServer(cctx, s.rdb)
		cancel()
		switch {
		case errors.Is(err, redistier.ErrRedisTooOld):
			return notBefore, 0, fmt.Errorf("idem: %w (or run without Redis, on Postgres alone)", err)
		case errors.Is(err, redistier.ErrNoSuchDatabase):
			setting := "Redis"
			if s.ownRDB {
				setting = "RedisURL"
			}
			return notBefore, 0, fmt.Errorf("idem: %s: %w", setting, err)
		case err != nil:
			s.log.Warn("redis not answering at start; events go to Postgres until it does", "err", err)
		}
	}
	return notBefore, former, nil
}

// close closes what the Service opened itself.
func (s *Service[T]) close() {
	if s.ownRDB && s.rdb != nil {
		s.rdb.Close()
	}
	if s.ownDBs {
		for _, p := range s.dbs {
			p.Close()
		}
	}
}

// Stats reports the consumer's state; before Run has started up it reports
// a consumer that is not consuming yet.
func (s *Service[T]) Stats() consumer.Stats {
	if c := s.running.Load(); c != nil {
		return c.Stats()
	}
	return consumer.Stats{Prefetch: s.cfg.Consumer.Prefetch}
}

// counting counts each settlement's outcome (by its name) for the
// heartbeat: one atomic add per delivery.
type counting struct{ c *heartbeat.Counter }

func (o counting) Settled(_ context.Context, st consumer.Settlement) { o.c.Add(st.Outcome.String(), 1) }
func (counting) Count(string, int)                                   {}
func (counting) Gathered(int)                                        {}

// observers tees the consumer's events to the metrics and the caller's
// own observer.
type observers [2]consumer.Observer

func (o observers) Settled(ctx context.Context, st consumer.Settlement) {
	o[0].Settled(ctx, st)
	o[1].Settled(ctx, st)
}

func (o observers) Count(counter string, n int) {
	o[0].Count(counter, n)
	o[1].Count(counter, n)
}

func (o observers) Gathered(deliveries int) {
	o[0].Gathered(deliveries)
	o[1].Gathered(deliveries)
}
