package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/config"
	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/telemetry"
	"github.com/idemhq/idem/migrations"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard/redistier"
	"github.com/idemhq/idem/pkg/idem"
)

func RunConsume(ctx context.Context, e *Env, args []string) error {
	fs := NewFlags(e, "consume", "Consumes the queue until SIGTERM or SIGINT, then drains: in-flight and\nprefetched events finish and are acked. Run any number of these\nprocesses on one queue. Applies pending migrations at start.")
	path := fs.String("config", "", "YAML config `file`")
	host, _ := os.Hostname()
	name := fs.String("name", fmt.Sprintf("idem-consume-%s-%d", host, os.Getpid()), "client-provided RabbitMQ connection `name`")
	statsFile := fs.String("stats-file", "", "write the outcome counts as JSON to this `file` every second and on exit")
	noMigrate := fs.Bool("no-migrate", false, "do not apply pending migrations at start; refuse to start if one is missing")
	only := fs.String("partition", "", "consume only these partitions (`K[,K…]`, of 0 to partitions-1); default: all")
	if err := Parse(fs, args); err != nil {
		return err
	}
	partitions, err := parsePartitions(*only)
	if err != nil {
		fmt.Fprintf(e.Stderr, "idem consume: --partition: %v\n", err)
		return ErrUsage
	}
	cfg, log, dbs, err := e.LoadDBFor(ctx, *path, ConsumeBounds)
	if err != nil {
		return err
	}
	defer dbs.Close()
	for _, p := range partitions {
		if p >= cfg.Partitions {
			return fmt.Errorf("--partition %d: the stream has %d partition(s), 0 to %d (the partitions setting, IDEM_PARTITIONS)", p, cfg.Partitions, cfg.Partitions-1)
		}
	}
	if *noMigrate {
		if err := requireMigrated(ctx, cfg, dbs, log, migrations.Guard, payments.Migrations); err != nil {
			return err
		}
	}
	TuneGC(e.Getenv)
	log = log.With("consumer", *name)
	rdb, err := RedisClient(cfg)
	if err != nil {
		return err
	}
	if rdb != nil {
		defer rdb.Close()
	}
	reg := telemetry.NewRegistry()
	sc := ServiceConfig(cfg, dbs, rdb, log)
	sc.Consumer.ConnectionName, sc.Consumer.Only = *name, partitions
	sc.Migrate, sc.Migrations = !*noMigrate, []migrations.Set{payments.Migrations}
	sc.Metrics = reg
	var rs []*relay.Relay
	if cfg.Outbox.Relay {
		if err := checkDestinations(ctx, cfg, dbs, log); err != nil {
			return err
		}
		if rs, err = newRelays(cfg, dbs, reg, log, *name+"-relay"); err != nil {
			return err
		}
	}
	run := serving{cfg: cfg, log: log, reg: reg, relays: rs, dbs: dbs, statsFile: *statsFile}
	if cfg.Handler == config.HandlerReceipts {
		err = serve(ctx, run, sc, payments.Receipts{Emit: cfg.Outbox.Emit})
	} else {
		err = serve(ctx, run, sc, payments.Handler{Receipts: cfg.Outbox.Emit})
	}
	switch {
	case errors.Is(err, consumer.ErrBrokerRefused) || errors.Is(err, consumer.ErrBrokerUnreachable):
		return amqpURLErr(err)
	case errors.Is(err, redistier.ErrNoSuchDatabase):
		return configErr(fmt.Errorf("redis_url (REDIS_URL): %w", err)) // a setting, not an outage
	}
	return err
}

// amqpURLErr names amqp_url in a failure to connect to RabbitMQ; a refusal
// that lasted (broker.ErrRefused) is a setting to fix, and exits 2.
func amqpURLErr(err error) error {
	err = fmt.Errorf("amqp_url: %w", err)
	if errors.Is(err, broker.ErrRefused) {
		return configErr(err)
	}
	return err
}

// serving is what a consume process serves besides its handler.
type serving struct {
	cfg       config.Config
	log       *slog.Logger
	reg       *prometheus.Registry
	relays    []*relay.Relay // outbox.relay: run beside the consumer
	dbs       Shards
	statsFile string
}

// serve runs h through the front door, with the process's telemetry and
// relays, until ctx ends and the service drained.
func serve[T any](ctx context.Context, s serving, sc idem.Config, h consumer.Handler[T]) error {
	svc, err := idem.New(sc, h)
	if err != nil {
		return err
	}
	log := s.log
	// Metrics and probes answer from the start, while start-up waits, and
	// until the drain is over, so that a scrape sees the end.
	if s.cfg.MetricsAddr != "" {
		health := svc.Health()
		if len(s.relays) > 0 {
			health = withRelayHealth(health, s.relays)
		}
		stop, err := serveTelemetry(ctx, s.cfg.MetricsAddr, telemetry.Handler(s.reg, health), log)
		if err != nil {
			return err
		}
		defer stop()
	}
	snapshot := func() any {
		snap, err := telemetry.Snapshot(s.reg)
		if err != nil {
			log.Error("read metrics", "err", err)
		}
		return snap
	}
	stopStats := func() {}
	if s.statsFile != "" {
		// Every second, so that a consumer killed with SIGKILL leaves
		// counts at most a second old (idem-lab chaos sums them).
		stopStats = telemetry.WriteStatsEvery(s.statsFile, time.Second, snapshot,
			func(err error) { log.Error("write stats file", "err", err) })
	}
	// The relays stop with the consumer: they start once the service has
	// migrated (Run does), and a relay that outlived the drain would only
	// publish what the next process publishes anyway.
	relayCtx, stopRelays := context.WithCancel(context.WithoutCancel(ctx))
	relaysDone := make(chan struct{})
	go func() {
		defer close(relaysDone)
		if len(s.relays) > 0 {
			waitForOutbox(relayCtx, s.dbs)
			relay.RunAll(relayCtx, s.relays)
		}
	}()
	err = svc.Run(ctx)
	stopRelays()
	<-relaysDone
	log.Info("stopped", "outcomes", snapshot())
	stopStats()
	return err
}

// ServiceConfig maps the file's settings onto the front door's: the one
// place they meet.
func ServiceConfig(cfg config.Config, dbs Shards, rdb redis.UniversalClient, log *slog.Logger) idem.Config {
	return idem.Config{
		Scope:          cfg.Scope,
		Databases:      dbs,
		Redis:          rdb,
		Fast:           cfg.FastConfig(),
		Consumer:       cfg.ConsumerConfig(),
		PruneInterval:  cfg.Postgres.PruneInterval,
		HistoryWithout: cfg.HistoryWithout(),
		Heartbeat:      heartbeatEvery(cfg),
		Logger:         log,
	}
}

// heartbeatEvery is the heartbeat setting as idem.Config takes it: the
// file's 0 turns it off.
func heartbeatEvery(cfg config.Config) time.Duration {
	if cfg.Heartbeat <= 0 {
		return -1
	}
	return cfg.Heartbeat
}

// RedisClient opens the client redis.mode and redis_url describe, or
// returns nil when the fast tier is off.
func RedisClient(cfg config.Config) (redis.UniversalClient, error) {
	if !cfg.Redis.Enabled {
		return nil, nil
	}
	return cfg.RedisClient()
}

// serveTelemetry serves h on addr until the returned func is called.
func serveTelemetry(ctx context.Context, addr string, h http.Handler, log *slog.Logger) (func(), error) {
	ln, err := telemetry.Listen(addr)
	if err != nil {
		return nil, err
	}
	serveCtx, stopServing := context.WithCancel(context.WithoutCancel(ctx))
	served := make(chan struct{})
	go func() {
		defer close(served)
		if err := telemetry.Serve(serveCtx, ln, h); err != nil {
			log.Error("metrics server", "err", err)
		}
	}()
	return func() { stopServing(); <-served }, nil
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

// consumerGCPercent is the garbage collector's target for consumers and
// relays: their live heap is a few MiB, so collecting at 4× it trades a few
// tens of MiB for a good share of the CPU the collector would take at the
// default 100.
const consumerGCPercent = 400

// TuneGC sets consumerGCPercent unless GOGC is set (idem consume, idem
// relay).
func TuneGC(getenv func(string) string) {
	if getenv("GOGC") == "" {
		debug.SetGCPercent(consumerGCPercent)
	}
}
