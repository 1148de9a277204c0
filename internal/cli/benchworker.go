package cli

import (
	"context"
	"errors"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/internal/bench"
	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/telemetry"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/metrics"
)

func runBenchWorker(ctx context.Context, e *env, args []string) error {
	fs := newFlags(e, "bench-worker", "One consumer process of 'idem bench', which starts it: it sets up, prints\n\"ready\", waits for a line on stdin, then consumes until SIGTERM, counting\nin --stats-file. --mode raw only acks; --mode idem runs the consumer as\n'idem consume' does, configured by the IDEM_* environment.")
	mode := fs.String("mode", "idem", "raw or idem")
	name := fs.String("name", "idem-bench", "RabbitMQ connection `name`")
	statsFile := fs.String("stats-file", "", "write counts as JSON to this `file`")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the measured part to this `file`")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *cpuProfile != "" {
		stop, err := bench.StartProfile(*cpuProfile)
		if err != nil {
			return err
		}
		defer stop()
	}
	if *statsFile == "" {
		return usageErr(e, "idem bench-worker: --stats-file is required")
	}
	cfg, log, err := e.loadConfig("")
	if err != nil {
		return err
	}
	tuneGC(e.getenv) // as idem consume does
	rec := &bench.Recorder{}
	if *mode == "raw" {
		return bench.Serve(ctx, *statsFile, rec, os.Stdin, e.stdout, func(ctx context.Context) error {
			return bench.RunRaw(ctx, cfg.AMQPURL, cfg.Queue, cfg.Consumer.Prefetch, rec)
		})
	}
	if *mode != "idem" {
		return usageErr(e, "idem bench-worker: --mode %q: want raw or idem", *mode)
	}
	pool, err := openPool(ctx, cfg, func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = rec.PGTracer() })
	if err != nil {
		return err
	}
	defer pool.Close()
	// The same metrics as idem consume, so that their cost is measured.
	reg := telemetry.NewRegistry()
	m, err := metrics.New(reg)
	if err != nil {
		return err
	}
	// The horizon recorded as idem consume records it, so that every claim
	// checks it, as in production.
	store := pgtier.New(pool)
	if _, err := store.EnforceRetention(ctx, cfg.Postgres.Retention, cfg.Consumer.ClockSkew); err != nil {
		return err
	}
	g, closeGuard, err := buildGuard(ctx, cfg, log, []guard.Store{store}, m, nil, func(rdb redis.UniversalClient) { rdb.AddHook(rec.RedisHook()) })
	if err != nil {
		return err
	}
	defer closeGuard()
	ccfg := consumerConfig(cfg, *name, log, recordingObserver{m, rec}, nil)
	c, err := consumer.New(ccfg, g, payments.Handler{})
	if err != nil {
		return err
	}
	if err := m.WatchConsumer(c.Stats); err != nil {
		return err
	}
	return bench.Serve(ctx, *statsFile, rec, os.Stdin, e.stdout, func(ctx context.Context) error {
		err := c.Run(ctx)
		snap, serr := telemetry.Snapshot(reg)
		rec.AddBreaker(snap)
		return errors.Join(err, serr)
	})
}

// recordingObserver feeds both the metrics and the bench's recorder.
type recordingObserver struct {
	*metrics.Metrics
	rec *bench.Recorder
}

func (o recordingObserver) Settled(ctx context.Context, s consumer.Settlement) {
	o.Metrics.Settled(ctx, s)
	o.rec.Settled(s.Message.Headers, s.Outcome)
}
