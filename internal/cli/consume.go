package cli

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/idemhq/idem/internal/config"
	"github.com/idemhq/idem/internal/crashpoint"
	"github.com/idemhq/idem/internal/fleet"
	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/telemetry"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/guard/redistier"
)

func runConsume(ctx context.Context, e *env, args []string) error {
	fs := newFlags(e, "consume", "Consumes the queue until SIGTERM or SIGINT, then drains: in-flight and\nprefetched events finish and are acked. Run any number of these\nprocesses on one queue. Applies pending migrations at start.")
	path := fs.String("config", "", "YAML config `file`")
	host, _ := os.Hostname()
	name := fs.String("name", fmt.Sprintf("idem-consume-%s-%d", host, os.Getpid()), "client-provided RabbitMQ connection `name`")
	statsFile := fs.String("stats-file", "", "write the outcome counts as JSON to this `file` every second and on exit")
	noMigrate := fs.Bool("no-migrate", false, "do not apply pending migrations at start")
	if err := parse(fs, args); err != nil {
		return err
	}
	cfg, log, pool, err := e.loadDB(ctx, *path)
	if err != nil {
		return err
	}
	defer pool.Close()
	crash, err := crashpoint.Hook(e.getenv)
	if err != nil {
		return err
	}
	log = log.With("consumer", *name)
	if !*noMigrate {
		if err := migrateWithRetry(ctx, pool, log); err != nil {
			return nil // only ctx ends the retries: a signal during start
		}
	}

	metrics := telemetry.New()
	gcfg := guard.Config{Scope: cfg.Scope, Store: pgtier.New(pool), Hook: crash, Logger: log}
	if cfg.Redis.Enabled {
		rdb, err := openRedis(cfg)
		if err != nil {
			return err
		}
		defer rdb.Close()
		fast, err := redistier.New(rdb, redisTierConfig(cfg, log, metrics))
		if err != nil {
			return err
		}
		gcfg.Fast = fast
	}
	g, err := guard.New(gcfg)
	if err != nil {
		return err
	}
	c, err := consumer.New(consumerConfig(cfg, *name, log, metrics, crash), g, payments.Handler{})
	if err != nil {
		return err
	}
	if cfg.MetricsAddr != "" {
		go func() {
			if err := metrics.Serve(ctx, cfg.MetricsAddr); err != nil {
				log.Error("metrics server", "err", err)
			}
		}()
	}
	stopStats := func() {}
	if *statsFile != "" {
		// Every second, so that a consumer killed with SIGKILL leaves
		// counts at most a second old (idem chaos sums them).
		stopStats = fleet.WriteStatsEvery(*statsFile, time.Second, func() any { return metrics.Snapshot() },
			func(err error) { log.Error("write stats file", "err", err) })
	}
	err = c.Run(ctx)
	log.Info("stopped", "outcomes", metrics)
	stopStats()
	return err
}

func redisTierConfig(cfg config.Config, log *slog.Logger, m *telemetry.Metrics) redistier.Config {
	return redistier.Config{
		Prefix:  cfg.Redis.Prefix,
		Lease:   cfg.Redis.Lease,
		DoneTTL: cfg.Redis.DoneTTL,
		Timeout: cfg.Redis.Timeout,
		Breaker: redistier.BreakerConfig{
			FailureThreshold: cfg.Redis.BreakerFailures,
			OpenTimeout:      cfg.Redis.BreakerOpenTimeout,
			HalfOpenRequests: cfg.Redis.BreakerHalfOpenRequests,
			OnStateChange: func(from, to string) {
				log.Warn("redis circuit breaker", "from", from, "to", to)
				m.BreakerChange(from, to)
			},
		},
	}
}

func consumerConfig(cfg config.Config, name string, log *slog.Logger, m *telemetry.Metrics, hook func(context.Context, guard.Step)) consumer.Config {
	return consumer.Config{
		URL:                 cfg.AMQPURL,
		Queue:               cfg.Queue,
		ConnectionName:      name,
		Prefetch:            cfg.Consumer.Prefetch,
		Workers:             cfg.Consumer.Workers,
		DeliveryLimit:       cfg.Consumer.DeliveryLimit,
		BrokerDeliveryLimit: cfg.Consumer.BrokerDeliveryLimit,
		HandlerTimeout:      cfg.Consumer.HandlerTimeout,
		Retention:           cfg.Postgres.Retention,
		RetryBackoff:        consumer.Backoff{Min: cfg.Consumer.RetryBackoffMin, Max: cfg.Consumer.RetryBackoffMax},
		DrainTimeout:        cfg.Consumer.DrainTimeout,
		ConfirmTimeout:      10 * time.Second,
		Hook:                hook,
		OnOutcome:           m.Outcome,
		Logger:              log,
	}
}
