// Package bench measures what idem costs: every configuration of the
// consumer side by side with a raw consume-and-ack baseline, on the same
// broker, database and Redis, in one run. It is `idem-lab bench`; each consumer
// is an `idem-lab bench-worker` process, so that its CPU can be read from /proc
// apart from the services'.
package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/fleet"
	"github.com/idemhq/idem/internal/loadgen"
	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/roundtrip"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/verify"
)

// Options describe a bench run.
type Options struct {
	Bin         string // the idem binary, for the workers
	Dir         string // worker logs and stats
	AMQPURL     string
	DatabaseURL string
	RedisURL    string
	Events      int     // messages per row
	Users       int     // distinct users the payments spread over
	Runs        int     // runs of each row; the table shows medians
	Prefill     int     // rows in the pre-filled dedup table
	Rate        float64 // offered rate of the latency row, messages/s
	LatencyFor  time.Duration
	Only        []string // row names to run (all if empty)
	// PGLatency is the round trip that the remote rows put between their
	// workers and PostgreSQL, a whole number of milliseconds; 0 leaves the
	// remote rows out.
	PGLatency time.Duration
	// BaselineBin, if set, is an idem-lab built from an earlier commit:
	// every idem row also runs with its bench-workers, beside the same
	// row with Bin's, in every run; which goes first alternates (runOrder).
	BaselineBin string
	// Profile writes a CPU profile of every worker into Dir.
	Profile  bool
	Seed     uint64
	Progress io.Writer
}

func (o *Options) validate() error {
	switch {
	case o.Events < 100:
		return fmt.Errorf("bench: --events must be at least 100, got %d", o.Events)
	case o.Runs < 1:
		return fmt.Errorf("bench: --runs must be at least 1, got %d", o.Runs)
	case o.Users < 1:
		return fmt.Errorf("bench: --users must be at least 1, got %d", o.Users)
	case o.Rate <= 0 || o.LatencyFor < time.Second:
		return fmt.Errorf("bench: --rate must be positive and --latency-for at least 1s")
	case o.Prefill < 0:
		return fmt.Errorf("bench: --prefill must not be negative")
	case o.PGLatency < 0 || o.PGLatency%time.Millisecond != 0:
		return fmt.Errorf("bench: --pg-latency must be a whole number of milliseconds (toxiproxy's unit), got %s", o.PGLatency)
	}
	if o.BaselineBin != "" {
		fi, err := os.Stat(o.BaselineBin)
		if err != nil {
			return fmt.Errorf("bench: --baseline-bin: %w", err)
		}
		if fi.IsDir() || fi.Mode()&0o111 == 0 {
			return fmt.Errorf("bench: --baseline-bin %s is not an executable file", o.BaselineBin)
		}
	}
	return nil
}

// BuildBaseline is Result.Build of the rows run with Options.BaselineBin's
// workers.
const BuildBaseline = "baseline"

// series is one row run with the workers of one build.
type series struct {
	row   Row
	bin   string
	build string // "" for this build, BuildBaseline
	runs  []runResult
}

func (s *series) label() string { return label(s.row.Name, s.build) }

// Run runs the rows and returns one Result per row.
func Run(ctx context.Context, o Options) ([]Result, error) {
	if err := o.validate(); err != nil {
		return nil, err
	}
	rows := Rows(o.PGLatency)
	if len(o.Only) > 0 {
		rows = slices.DeleteFunc(rows, func(r Row) bool { return !slices.Contains(o.Only, r.Name) })
		if len(rows) == 0 {
			return nil, fmt.Errorf("bench: --rows matched no row")
		}
	}
	admin, err := pgx.Connect(ctx, o.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("bench: connect to postgres: %w", err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	b := &bencher{o: o, admin: admin}
	if slices.ContainsFunc(rows, func(r Row) bool { return r.PGLatency > 0 }) {
		faults := sandbox.StartFaults()
		defer faults.Close()
		if b.remoteURL, err = b.remotePostgres(ctx, faults); err != nil {
			return nil, err
		}
	}
	// Each run makes and drops a schema; without autovacuum the catalogs
	// they leave dead rows in slow every later run down.
	b.vacuumCatalogs(ctx)
	if slices.ContainsFunc(rows, func(r Row) bool { return r.Prefilled }) {
		if err := b.prefill(ctx); err != nil {
			return nil, err
		}
	}
	// The baseline's idem rows run beside the same row with ours, on the
	// same stream, so that the two builds alternate row by row and share
	// whatever the machine does meanwhile; which of the two goes first
	// alternates from run to run (runOrder). The raw rows run once: a
	// consume-and-ack loop is the machine's ceiling, not the build's.
	var all []*series
	for _, row := range rows {
		all = append(all, &series{row: row, bin: o.Bin})
		if o.BaselineBin != "" && row.Mode == "idem" {
			all = append(all, &series{row: row, bin: o.BaselineBin, build: BuildBaseline})
		}
	}
	// Runs go round the rows, so that a slow spell of the machine (a
	// checkpoint, say) lands on every row alike rather than on one.
	for run := range o.Runs {
		for i, s := range runOrder(all, run) {
			b.progress("[run %d/%d, row %d/%d] %s", run+1, o.Runs, i+1, len(all), s.label())
			r, err := b.runRow(ctx, s.row, s.bin, run)
			if err != nil {
				return nil, fmt.Errorf("bench: %s: %w", s.label(), err)
			}
			b.progress("    %.0f msg/s, %.0f µs CPU/msg, %.3f Postgres and %.3f Redis round trips/msg", r.Rate, r.CPU.Total(), r.PGTrips, r.RedisTrips)
			s.runs = append(s.runs, r)
		}
	}
	results := make([]Result, len(all))
	for i, s := range all {
		results[i] = summarize(s.row, s.runs)
		results[i].Build = s.build
	}
	ratios(results)
	return results, nil
}

// runOrder is the order the series of all run in, in run number run: as
// listed in even runs, and in odd runs with each row's baseline series
// ahead of the one with this build, so that neither build always runs
// second, on what the first left behind (Redis's keys, the WAL, a
// checkpoint it set off), nor always first.
func runOrder(all []*series, run int) []*series {
	out := slices.Clone(all)
	if run%2 == 0 {
		return out
	}
	for i := 0; i+1 < len(out); i++ {
		if out[i+1].build == BuildBaseline && out[i+1].row.Name == out[i].row.Name {
			out[i], out[i+1] = out[i+1], out[i]
			i++
		}
	}
	return out
}

// remotePostgres puts a link with Options.PGLatency of round trip in front
// of the configured PostgreSQL and returns the URL that reaches it through
// the link. It checks that a round trip through the link takes at least
// that long, and says how long it takes beside a direct one.
func (b *bencher) remotePostgres(ctx context.Context, faults *sandbox.Faults) (string, error) {
	link, u, err := faults.LinkURL("bench-pg", b.o.DatabaseURL)
	if err != nil {
		return "", fmt.Errorf("bench: --pg-latency: %w", err)
	}
	if err := link.LatencyOneWay(b.o.PGLatency); err != nil {
		return "", fmt.Errorf("bench: --pg-latency: %w", err)
	}
	conn, err := pgx.Connect(ctx, u)
	if err != nil {
		return "", fmt.Errorf("bench: connect to postgres through the --pg-latency link: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	via, err := fastestTrip(ctx, conn)
	if err != nil {
		return "", err
	}
	direct, err := fastestTrip(ctx, b.admin)
	if err != nil {
		return "", err
	}
	if via < b.o.PGLatency {
		return "", fmt.Errorf("bench: a round trip through the --pg-latency link took %s, less than %s", via, b.o.PGLatency)
	}
	b.progress("Postgres %s away: a SELECT 1 takes %s through the link, %s direct", b.o.PGLatency, via.Round(10*time.Microsecond), direct.Round(10*time.Microsecond))
	return u, nil
}

// fastestTrip is the fastest of ten SELECT 1 round trips on conn.
func fastestTrip(ctx context.Context, conn *pgx.Conn) (time.Duration, error) {
	best := time.Duration(math.MaxInt64)
	for range 10 {
		began := time.Now()
		if _, err := conn.Exec(ctx, "SELECT 1"); err != nil {
			return 0, fmt.Errorf("bench: time a round trip: %w", err)
		}
		best = min(best, time.Since(began))
	}
	return best, nil
}

type bencher struct {
	o         Options
	admin     *pgx.Conn // schemas, checkpoints, vacuum: one connection for the whole run
	seq       int
	schema    string // the pre-filled schema, once made
	remoteURL string // the configured database through the --pg-latency link
}

func (b *bencher) progress(format string, args ...any) {
	if b.o.Progress != nil {
		fmt.Fprintf(b.o.Progress, format+"\n", args...)
	}
}

// runResult is one run of one row.
type runResult struct {
	Rate        float64 // messages per second
	CPU         CPU     // µs per message
	PGTrips     float64 // Postgres round trips per message
	PGCauses    map[roundtrip.Cause]CauseCost
	RedisTrips  float64 // Redis round trips per message
	RSS         int64   // the largest consumer peak RSS, bytes
	Errors      int64   // requeues and dead letters
	Breaker     int64   // breaker transitions
	Doubled     int
	Missing     int
	P50, P99    float64 // latency, ms (latency row)
	BytesPerKey float64 // Redis memory per done key
	StartupMs   float64 // from "go" to the consumer's registration
	Outcomes    map[string]int64
}

// CPU is CPU time per message, in microseconds, by tier.
type CPU struct {
	Consumer float64 `json:"consumer"`
	Postgres float64 `json:"postgres"`
	RabbitMQ float64 `json:"rabbitmq"`
	Redis    float64 `json:"redis"`
}

// Total is the CPU of all tiers.
func (c CPU) Total() float64 { return c.Consumer + c.Postgres + c.RabbitMQ + c.Redis }

// runRow sets up a fresh queue, schema and Redis prefix, runs the row's
// workers (bin's bench-worker) over its stream, measures, verifies and
// cleans up.
func (b *bencher) runRow(ctx context.Context, row Row, bin string, run int) (runResult, error) {
	b.seq++
	name := fmt.Sprintf("b%d%04x", b.seq, rand.Uint32()&0xffff)
	queue := "idem.bench." + name
	topo := broker.TopologyFor(queue, 0)
	defer deleteQueue(b.o.AMQPURL, topo)

	urls, pool, dropDB, err := b.rowDatabase(ctx, row, name)
	if err != nil {
		return runResult{}, err
	}
	defer dropDB()
	rdb, err := redisClient(b.o.RedisURL)
	if err != nil {
		return runResult{}, err
	}
	defer rdb.Close()
	defer deleteKeys(rdb, name)

	spec, stream, err := b.stream(row, run, name)
	if err != nil {
		return runResult{}, err
	}
	redisOn := row.Mode == "idem" && !row.RedisDown && !slices.Contains(row.Env, redisOff)
	pub := loadgen.PublishOptions{URL: b.o.AMQPURL, Topology: topo, ConnectionName: "idem-bench-publish"}
	if row.Dups == 1 && row.Mode == "idem" {
		if err := b.processOnce(ctx, bin, row, b.workerEnv(row, urls.direct, queue, name), name, pub, stream); err != nil {
			return runResult{}, fmt.Errorf("process the stream once: %w", err)
		}
	}
	if !row.Latency {
		if err := loadgen.Publish(ctx, pub, stream); err != nil {
			return runResult{}, err
		}
	}

	workers, err := startWorkers(bin, b.o.Dir, name, row, b.workerEnv(row, urls.workers, queue, name), b.o.Profile)
	if err != nil {
		return runResult{}, err
	}
	defer workers.kill()

	// Every run starts just after a checkpoint, so that none pays for
	// one mid-run and each writes the same full-page images.
	b.checkpoint(ctx)
	waitQuiet(10 * time.Second)
	// The inspector's connection is opened by its first look, before the
	// workers start, so that its dial is not timed. The latency row
	// publishes its stream only once they consume: its queue is declared
	// here, for that look.
	if row.Latency {
		if err := sandbox.DeclareTopology(b.o.AMQPURL, topo); err != nil {
			return runResult{}, err
		}
	}
	queues := sandbox.NewInspector(b.o.AMQPURL)
	defer queues.Close()
	if _, err := queues.Consumers(topo.Queue); err != nil {
		return runResult{}, err
	}
	began := time.Now()
	if err := workers.start(); err != nil {
		return runResult{}, err
	}
	// Throughput and CPU are the consuming's: they are measured from the
	// moment a consumer is on the queue, after the worker's start-up (its
	// connections and checks), which is a fixed cost a short run would
	// otherwise spread over its messages. The start-up gets its own figure.
	if err := waitConsumed(ctx, queues, topo.Queue, time.Minute); err != nil {
		return runResult{}, err
	}
	before, err := sampleCPU(workers.pids())
	if err != nil {
		return runResult{}, err
	}
	start := time.Now()
	startup := start.Sub(began)
	pubErr := make(chan error, 1)
	if row.Latency {
		pub.Rate, pub.StampSent = b.o.Rate, true
		go func() { pubErr <- loadgen.Publish(ctx, pub, stream) }()
	} else {
		pubErr <- nil
	}
	messages := int64(len(stream.Order))
	if err := workers.waitSettled(ctx, messages, b.o.LatencyFor+5*time.Minute); err != nil {
		return runResult{}, err
	}
	after, err := sampleCPU(workers.pids())
	if err != nil {
		return runResult{}, err
	}
	if err := <-pubErr; err != nil {
		return runResult{}, err
	}
	var rss int64
	for _, pid := range workers.pids() {
		rss = max(rss, peakRSS(pid))
	}
	stats, err := workers.stop()
	if err != nil {
		return runResult{}, err
	}

	r := sumRun(stats, start, messages, cpuDelta(before, after), row.Latency)
	r.RSS = rss
	r.StartupMs = float64(startup.Microseconds()) / 1e3
	if row.Mode == "idem" {
		rep, err := verify.Check(ctx, pool, loadgen.NewManifest(spec, queue, stream))
		if err != nil {
			return r, err
		}
		r.Doubled, r.Missing = rep.Doubled, rep.Missing
		if redisOn {
			r.BytesPerKey = bytesPerKey(ctx, rdb, name)
		}
	}
	return r, nil
}

// rowURLs are the URLs of a row's schema.
type rowURLs struct {
	workers string // through the --pg-latency link for a remote row
	direct  string
}

// rowDatabase returns the URLs of the row's schema (a fresh one, or the
// prefilled one), a pool on it for the verification, which connects direct
// (nil for a raw row), and a func that closes the pool and drops a fresh
// schema.
func (b *bencher) rowDatabase(ctx context.Context, row Row, name string) (rowURLs, *pgxpool.Pool, func(), error) {
	schema := name
	var cleanups []func()
	done := func() {
		for _, c := range slices.Backward(cleanups) {
			c()
		}
	}
	if row.Prefilled {
		schema = b.schema
	} else if row.Mode == "idem" {
		if err := b.createSchema(ctx, schema); err != nil {
			return rowURLs{}, nil, done, err
		}
		cleanups = append(cleanups, func() { b.dropSchema(schema) })
	}
	urls := rowURLs{workers: b.o.DatabaseURL, direct: sandbox.WithParam(b.o.DatabaseURL, "search_path", schema)}
	if row.PGLatency > 0 {
		urls.workers = b.remoteURL
	}
	urls.workers = sandbox.WithParam(urls.workers, "search_path", schema)
	if row.Mode != "idem" {
		return urls, nil, done, nil
	}
	pool, err := pgxpool.New(ctx, urls.direct)
	if err != nil {
		return rowURLs{}, nil, done, err
	}
	cleanups = append(cleanups, pool.Close)
	return urls, pool, done, nil
}

// workerEnv is the environment of a row's workers.
func (b *bencher) workerEnv(row Row, dbURL, queue, name string) []string {
	redisURL := b.o.RedisURL
	if row.RedisDown {
		redisURL = "redis://127.0.0.1:1/0" // nothing listens on port 1
	}
	env := []string{
		"AMQP_URL=" + b.o.AMQPURL, "DATABASE_URL=" + dbURL, "REDIS_URL=" + redisURL,
		"IDEM_QUEUE=" + queue, "IDEM_REDIS_PREFIX=" + name, "IDEM_LOG_LEVEL=warn",
	}
	return append(env, row.Env...)
}

// sumRun sums the workers' final stats over a run of messages that
// began at start and used cpu seconds per tier.
func sumRun(stats []WorkerStats, start time.Time, messages int64, cpu map[Tier]float64, latency bool) runResult {
	var r runResult
	var last, pgTrips, redisTrips int64
	var lat []int64
	causes := map[roundtrip.Cause]roundtrip.Cost{}
	for _, s := range stats {
		for c, n := range s.PGCauses {
			causes[c] = roundtrip.Cost{Trips: causes[c].Trips + n.Trips, WaitMicros: causes[c].WaitMicros + n.WaitMicros}
		}
		last = max(last, s.Last)
		for o, n := range s.Outcomes {
			if r.Outcomes == nil {
				r.Outcomes = map[string]int64{}
			}
			r.Outcomes[o] += n
		}
		pgTrips += s.PGTrips
		redisTrips += s.RedisTrips
		r.Errors += s.Retried + s.DeadLetter
		r.Breaker += s.Breaker
		lat = append(lat, s.LatencyMicros...)
	}
	elapsed := time.Unix(0, last).Sub(start).Seconds()
	r.Rate = float64(messages) / elapsed
	per := 1e6 / float64(messages)
	r.CPU = CPU{Consumer: cpu[TierConsumer] * per, Postgres: cpu[TierPostgres] * per, RabbitMQ: cpu[TierRabbitMQ] * per, Redis: cpu[TierRedis] * per}
	r.PGTrips = float64(pgTrips) / float64(messages)
	r.RedisTrips = float64(redisTrips) / float64(messages)
	for c, n := range causes {
		if r.PGCauses == nil {
			r.PGCauses = map[roundtrip.Cause]CauseCost{}
		}
		r.PGCauses[c] = CauseCost{Trips: float64(n.Trips) / float64(messages), WaitMicros: float64(n.WaitMicros) / float64(messages)}
	}
	if latency {
		r.P50, r.P99 = percentile(lat, 0.50), percentile(lat, 0.99)
	}
	return r
}

// stream builds the row's stream: Events messages, of which the row's Dups
// fraction are re-sends.
func (b *bencher) stream(row Row, run int, name string) (loadgen.StreamSpec, loadgen.Stream, error) {
	n := b.o.Events
	if row.Latency {
		n = int(b.o.Rate * b.o.LatencyFor.Seconds())
	}
	spec := loadgen.StreamSpec{RunID: name, Count: n, Users: b.o.Users, Seed: b.o.Seed + uint64(run), DelayWindow: 1000}
	if row.Dups > 0 && row.Dups < 1 {
		spec.Count = int(float64(n) * (1 - row.Dups))
		spec.DupRatio = row.Dups / (1 - row.Dups)
	}
	s, err := loadgen.Build(spec)
	return spec, s, err
}

// processOnce publishes the stream and has a set of the row's workers
// (bin's, env's) settle it, so that the row's messages are all duplicates:
// the stream has been processed once, as those workers would have. They
// are the row's build's, so that what they leave behind (dedup rows, done
// markers) is in that build's format: a baseline's Redis tier need not
// read this build's markers. env should connect direct.
func (b *bencher) processOnce(ctx context.Context, bin string, row Row, env []string, name string, pub loadgen.PublishOptions, stream loadgen.Stream) error {
	if err := loadgen.Publish(ctx, pub, stream); err != nil {
		return err
	}
	ws, err := startWorkers(bin, b.o.Dir, name+"-once", row, env, false)
	defer ws.kill()
	if err != nil {
		return err
	}
	if err := ws.start(); err != nil {
		return err
	}
	if err := ws.waitSettled(ctx, int64(len(stream.Order)), 5*time.Minute); err != nil {
		return err
	}
	_, err = ws.stop()
	return err
}

// prefill makes the schema of the pre-filled row: idem's tables with
// Options.Prefill dedup rows of random IDs. The primary key is built after
// the load, as a restore would.
func (b *bencher) prefill(ctx context.Context) error {
	b.schema = fmt.Sprintf("idem_bench_prefilled_%d", b.o.Prefill)
	conn := b.admin
	var n int64
	err := conn.QueryRow(ctx, `SELECT coalesce((SELECT reltuples::bigint FROM pg_class c JOIN pg_namespace s ON s.oid = c.relnamespace
		WHERE s.nspname = $1 AND c.relname = 'idem_processed'), -1)`, b.schema).Scan(&n)
	if err != nil {
		return err
	}
	if n >= int64(b.o.Prefill) {
		b.progress("pre-filled table %s.idem_processed is there (%d rows): reusing it", b.schema, n)
		return nil
	}
	b.progress("pre-filling %s.idem_processed with %d rows (once; later runs reuse it)...", b.schema, b.o.Prefill)
	began := time.Now()
	if _, err := conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+b.schema+" CASCADE"); err != nil {
		return err
	}
	if err := b.createSchema(ctx, b.schema); err != nil {
		return err
	}
	for _, q := range []string{
		"SET search_path = " + b.schema,
		`ALTER TABLE idem_processed DROP CONSTRAINT idem_processed_pkey`,
		`DROP INDEX idem_processed_processed_at`,
		fmt.Sprintf(`INSERT INTO idem_processed (scope, event_id, payload_hash, processed_at)
			SELECT 'payments', 'evt_' || md5(g::text), sha256(g::text::bytea), now() - (g %% 86400) * interval '1 second'
			FROM generate_series(1, %d) AS g`, b.o.Prefill),
		`ALTER TABLE idem_processed ADD PRIMARY KEY (scope, event_id)`,
		`CREATE INDEX idem_processed_processed_at ON idem_processed (processed_at)`,
		`VACUUM ANALYZE idem_processed`,
		`RESET search_path`,
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			return fmt.Errorf("pre-fill: %w", err)
		}
	}
	b.progress("pre-filled in %s", time.Since(began).Round(time.Second))
	return nil
}

// vacuumCatalogs vacuums the system catalogs that making and dropping
// schemas churns, if the user may.
func (b *bencher) vacuumCatalogs(ctx context.Context) {
	_, _ = b.admin.Exec(ctx, `VACUUM pg_catalog.pg_attribute, pg_catalog.pg_depend, pg_catalog.pg_class,
		pg_catalog.pg_index, pg_catalog.pg_type, pg_catalog.pg_constraint, pg_catalog.pg_namespace,
		pg_catalog.pg_attrdef, pg_catalog.pg_sequence`)
}

// checkpoint runs CHECKPOINT, if the user may.
func (b *bencher) checkpoint(ctx context.Context) {
	_, _ = b.admin.Exec(ctx, "CHECKPOINT")
}

// createSchema makes schema with idem's and the payments tables.
func (b *bencher) createSchema(ctx context.Context, schema string) error {
	for _, q := range []string{"CREATE SCHEMA " + schema, "SET search_path = " + schema} {
		if _, err := b.admin.Exec(ctx, q); err != nil {
			return err
		}
	}
	_, err := payments.Migrate(ctx, b.admin)
	if _, rerr := b.admin.Exec(ctx, "RESET search_path"); err == nil {
		err = rerr
	}
	return err
}

func (b *bencher) dropSchema(schema string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, _ = b.admin.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE")
}

// waitConsumed returns once queue has a consumer (a worker finished its
// start-up), polling every 2 ms; each poll is one round trip to the broker.
func waitConsumed(ctx context.Context, queues *sandbox.Inspector, queue string, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for {
		n, err := queues.Consumers(queue)
		if err != nil {
			return fmt.Errorf("bench: %w", err)
		}
		if n > 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("bench: no worker consumed from %s within %s of its start", queue, limit)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(2 * time.Millisecond):
		}
	}
}

func deleteQueue(url string, t broker.Topology) {
	conn, err := amqp.Dial(url)
	if err != nil {
		return
	}
	defer conn.Close()
	if ch, err := conn.Channel(); err == nil {
		_, _ = ch.QueueDelete(t.Queue, false, false, false)
		_, _ = ch.QueueDelete(t.DeadLetterQueue, false, false, false)
		_ = ch.ExchangeDelete(t.DeadLetterExchange, false, false)
	}
}

func redisClient(url string) (*redis.Client, error) {
	opt, err := redis.ParseURL(url)
	if err != nil {
		return nil, fmt.Errorf("redis_url: %w", err)
	}
	opt.ContextTimeoutEnabled = true
	return redis.NewClient(opt), nil
}

func deleteKeys(rdb *redis.Client, prefix string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	iter := rdb.Scan(ctx, 0, prefix+":*", 1000).Iterator()
	var keys []string
	for iter.Next(ctx) {
		if keys = append(keys, iter.Val()); len(keys) == 1000 {
			rdb.Unlink(ctx, keys...)
			keys = keys[:0]
		}
	}
	if len(keys) > 0 {
		rdb.Unlink(ctx, keys...)
	}
}

// bytesPerKey is the median MEMORY USAGE of up to 200 of the row's keys.
func bytesPerKey(ctx context.Context, rdb *redis.Client, prefix string) float64 {
	var sizes []int64
	iter := rdb.Scan(ctx, 0, prefix+":*", 1000).Iterator()
	for len(sizes) < 200 && iter.Next(ctx) {
		if n, err := rdb.MemoryUsage(ctx, iter.Val()).Result(); err == nil {
			sizes = append(sizes, n*1000) // percentile divides by 1000
		}
	}
	return percentile(sizes, 0.5)
}

func percentile(v []int64, p float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return float64(s[min(len(s)-1, int(math.Ceil(p*float64(len(s))))-1)]) / 1000
}

// workerSet is a row's worker processes.
type workerSet struct {
	procs []*fleet.Proc
}

func startWorkers(bin, dir, name string, row Row, env []string, profile bool) (*workerSet, error) {
	ws := &workerSet{}
	for i := range row.Procs {
		wname := fmt.Sprintf("%s-%d", name, i)
		args := []string{"--mode", row.Mode}
		if profile {
			args = append(args, "--cpuprofile", filepath.Join(dir, wname+".pprof"))
		}
		p, err := fleet.Start(fleet.Spec{Bin: bin, Command: "bench-worker", Name: wname, Dir: dir, Env: env, Args: args, Handshake: true})
		if err != nil {
			return ws, fmt.Errorf("worker %s: %w", wname, err)
		}
		ws.procs = append(ws.procs, p)
	}
	return ws, nil
}

func (ws *workerSet) pids() []int {
	out := make([]int, len(ws.procs))
	for i, p := range ws.procs {
		out[i] = p.PID()
	}
	return out
}

func (ws *workerSet) start() error {
	for _, p := range ws.procs {
		if err := p.Release(); err != nil {
			return err
		}
	}
	return nil
}

func (ws *workerSet) snapshot() ([]WorkerStats, error) {
	out := make([]WorkerStats, len(ws.procs))
	for i, p := range ws.procs {
		b, err := os.ReadFile(p.StatsPath)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				continue
			}
			return nil, err
		}
		if err := json.Unmarshal(b, &out[i]); err != nil {
			continue // caught mid-write; the next poll reads it
		}
	}
	return out, nil
}

// waitSettled polls the workers' stats until they settled n deliveries.
func (ws *workerSet) waitSettled(ctx context.Context, n int64, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		stats, err := ws.snapshot()
		if err != nil {
			return err
		}
		var settled int64
		for _, s := range stats {
			settled += s.Settled + s.DeadLetter
		}
		if settled >= n {
			return nil
		}
		for _, p := range ws.procs {
			select {
			case <-p.Done():
				return fmt.Errorf("worker %s exited early: %v", p.Name, p.Err())
			default:
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("settled %d of %d messages in %s", settled, n, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// stop ends the workers with SIGTERM, all at once, and returns their final
// stats.
func (ws *workerSet) stop() ([]WorkerStats, error) {
	errs := make([]error, len(ws.procs))
	var wg sync.WaitGroup
	for i, p := range ws.procs {
		wg.Go(func() { errs[i] = p.Stop(time.Minute) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return ws.snapshot()
}

func (ws *workerSet) kill() {
	for _, p := range ws.procs {
		p.Kill()
	}
}
