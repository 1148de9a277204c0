package harness

import (
	"context"
	"errors"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/internal/bench"
	"github.com/idemhq/idem/internal/cli"
	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/telemetry"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/idem"
)

func runBenchWorker(ctx context.Context, e *cli.Env, args []string) error {
	fs := cli.NewFlags(e, "bench-worker", "One consumer process of 'idem-lab bench', which starts it: it sets up, prints\n\"ready\", waits for a line on stdin, then consumes until SIGTERM, counting\nin --stats-file. --mode raw only acks; --mode idem runs the consumer as\n'idem consume' does, configured by the IDEM_* environment. --mode\nconfirm-publish is the outbox rows' raw confirming publisher instead: it\npublishes --messages to IDEM_QUEUE, --in-flight at a time, then waits.")
	mode := fs.String("mode", "idem", "raw, idem or confirm-publish")
	messages := fs.Int("messages", 0, "with --mode confirm-publish, how many messages to publish")
	inFlight := fs.Int("in-flight", 0, "with --mode confirm-publish, how many publishes await their confirms at a time")
	name := fs.String("name", "idem-bench", "RabbitMQ connection `name`")
	statsFile := fs.String("stats-file", "", "write counts as JSON to this `file`")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the measured part to this `file`")
	if err := cli.Parse(fs, args); err != nil {
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
		return cli.UsageErr(e, "idem-lab bench-worker: --stats-file is required")
	}
	cfg, log, err := e.LoadConfig("")
	if err != nil {
		return err
	}
	cli.TuneGC(e.Getenv) // as idem consume does
	rec := &bench.Recorder{}
	if *mode == "raw" {
		return bench.Serve(ctx, *statsFile, rec, os.Stdin, e.Stdout, func(ctx context.Context) error {
			return bench.RunRaw(ctx, cfg.AMQPURL, cfg.Queue, cfg.Consumer.Prefetch, rec)
		})
	}
	if *mode == "confirm-publish" {
		if *messages < 1 || *inFlight < 1 {
			return cli.UsageErr(e, "idem-lab bench-worker: --mode confirm-publish needs --messages and --in-flight of at least 1")
		}
		return bench.Serve(ctx, *statsFile, rec, os.Stdin, e.Stdout, func(ctx context.Context) error {
			return bench.RunConfirmPublisher(ctx, cfg.AMQPURL, cfg.Queue, *messages, *inFlight, rec)
		})
	}
	if *mode != "idem" {
		return cli.UsageErr(e, "idem-lab bench-worker: --mode %q: want raw, idem or confirm-publish", *mode)
	}
	pool, err := cli.OpenPool(ctx, cfg, func(pc *pgxpool.Config) { pc.ConnConfig.Tracer = rec.PGTracer() })
	if err != nil {
		return err
	}
	defer pool.Close()
	rdb, err := cli.RedisClient(cfg)
	if err != nil {
		return err
	}
	if rdb != nil {
		rdb.AddHook(rec.RedisHook())
		defer rdb.Close()
	}
	// As idem consume runs, with the same metrics, so that their cost is
	// measured, and the horizon recorded, so that every claim checks it.
	reg := telemetry.NewRegistry()
	sc := cli.ServiceConfig(cfg, cli.Shards{pool}, rdb, log)
	sc.Consumer.ConnectionName = *name
	sc.Consumer.Observer = recordingObserver{rec}
	sc.Metrics = reg
	svc, err := idem.New(sc, payments.Handler{})
	if err != nil {
		return err
	}
	return bench.Serve(ctx, *statsFile, rec, os.Stdin, e.Stdout, func(ctx context.Context) error {
		err := svc.Run(ctx)
		snap, serr := telemetry.Snapshot(reg)
		rec.AddBreaker(snap)
		return errors.Join(err, serr)
	})
}

// recordingObserver feeds the bench's recorder; the service's metrics see
// every settlement too.
type recordingObserver struct{ rec *bench.Recorder }

func (o recordingObserver) Settled(_ context.Context, s consumer.Settlement) {
	o.rec.Settled(s.Message.Headers, s.Outcome)
}
func (recordingObserver) Count(string, int) {}
func (recordingObserver) Gathered(int)      {}
