package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/internal/loadgen"
	"github.com/idemhq/idem/internal/roundtrip"
	"github.com/idemhq/idem/internal/telemetry"
	"github.com/idemhq/idem/pkg/guard"
)

// WorkerStats is what a bench worker reports in its stats file, every 50ms
// and when it exits.
type WorkerStats struct {
	Settled    int64 `json:"settled"` // deliveries acked: processed or duplicate
	Retried    int64 `json:"retried"` // deliveries handed back to the queue
	DeadLetter int64 `json:"deadLettered"`
	PGTrips    int64 `json:"pgTrips"`
	RedisTrips int64 `json:"redisTrips"`
	Breaker    int64 `json:"breakerTransitions"`
	Last       int64 `json:"last"` // unix nanoseconds of the last settlement
	// PGCauses splits PGTrips by cause, with the time waited on them. A
	// worker of an earlier build writes none.
	PGCauses map[roundtrip.Cause]roundtrip.Cost `json:"pgCauses,omitempty"`
	// Outcomes counts settlements by outcome.
	Outcomes map[string]int64 `json:"outcomes,omitempty"`
	// LatencyMicros holds publish-to-ack latencies of stamped messages, in
	// microseconds; only in the final report.
	LatencyMicros []int64 `json:"latencyMicros,omitempty"`
}

// Recorder counts a worker's settlements and round trips. It is safe for
// concurrent use.
type Recorder struct {
	settled, retried, dead, redis, breaker, last atomic.Int64
	pg                                           roundtrip.ByCause

	mu        sync.Mutex
	latencies []int64
	outcomes  map[string]int64
	firstSent int64 // the earliest publish time seen, unix nanoseconds
}

// warmUp is how long after the first stamped message latencies are left out:
// connections, prepared statements and caches are being set up.
const warmUp = time.Second

// Settled records one delivery's outcome; headers are its AMQP headers.
func (r *Recorder) Settled(headers amqp.Table, o guard.Outcome) {
	now := time.Now()
	switch o {
	case guard.OutcomeRetry:
		r.retried.Add(1)
		return
	case guard.OutcomeDeadLettered:
		r.dead.Add(1)
	default:
		r.settled.Add(1)
	}
	r.last.Store(now.UnixNano())
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.outcomes == nil {
		r.outcomes = map[string]int64{}
	}
	r.outcomes[o.String()]++
	if sent, ok := headers[loadgen.HeaderSentAt].(int64); ok {
		if r.firstSent == 0 || sent < r.firstSent {
			r.firstSent = sent
		}
		if time.Duration(sent-r.firstSent) >= warmUp {
			r.latencies = append(r.latencies, now.Sub(time.Unix(0, sent)).Microseconds())
		}
	}
}

// AddBreaker adds the circuit breaker transitions in a telemetry snapshot
// ("breaker/from->to" keys).
func (r *Recorder) AddBreaker(snapshot map[string]int64) {
	for k, v := range snapshot {
		if strings.HasPrefix(k, "breaker/") {
			r.breaker.Add(v)
		}
	}
}

// Snapshot returns the counts; with final, the latencies too.
func (r *Recorder) Snapshot(final bool) WorkerStats {
	s := WorkerStats{Settled: r.settled.Load(), Retried: r.retried.Load(), DeadLetter: r.dead.Load(),
		PGTrips: r.pg.Total(), RedisTrips: r.redis.Load(), Breaker: r.breaker.Load(), Last: r.last.Load(),
		PGCauses: r.pg.Snapshot()}
	r.mu.Lock()
	s.Outcomes = maps.Clone(r.outcomes)
	if final {
		s.LatencyMicros = slices.Clone(r.latencies)
	}
	r.mu.Unlock()
	return s
}

// PGTracer counts Postgres round trips and times them, by cause.
func (r *Recorder) PGTracer() pgx.QueryTracer { return r.pg.Tracer() }

// RedisHook counts Redis round trips.
func (r *Recorder) RedisHook() redis.Hook { return roundtrip.Redis(&r.redis) }

// Serve runs a bench worker's life around run: it prints "ready" on out once
// set-up is done, waits for a line on in, runs until ctx ends, and keeps the
// stats file current meanwhile. run must return when ctx ends.
func Serve(ctx context.Context, statsFile string, r *Recorder, in io.Reader, out io.Writer, run func(ctx context.Context) error) error {
	fmt.Fprintln(out, "ready")
	if _, err := bufio.NewReader(in).ReadString('\n'); err != nil {
		return fmt.Errorf("bench worker: waiting for go: %w", err)
	}
	stop := telemetry.WriteStatsEvery(statsFile, 50*time.Millisecond, func() any { return r.Snapshot(false) }, nil)
	err := run(ctx)
	stop()
	// The last word, with the latencies.
	b, merr := json.Marshal(r.Snapshot(true))
	if merr != nil {
		return merr
	}
	if werr := os.WriteFile(statsFile, b, 0o644); werr != nil && err == nil {
		err = werr
	}
	return err
}

// StartProfile starts a CPU profile written to path; call stop to end it.
func StartProfile(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
}

// RunRaw is the baseline: consume the queue and ack every delivery, one ack
// per delivery, and nothing else.
func RunRaw(ctx context.Context, url, queue string, prefetch int, r *Recorder) error {
	conn, err := amqp.Dial(url)
	if err != nil {
		return fmt.Errorf("raw: dial: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if err := ch.Qos(prefetch, 0, false); err != nil {
		return err
	}
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("raw: consume: %w", err)
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case d, ok := <-deliveries:
			if !ok {
				return fmt.Errorf("raw: deliveries closed")
			}
			if err := d.Ack(false); err != nil {
				return err
			}
			r.Settled(d.Headers, guard.OutcomeProcessed)
		}
	}
}
