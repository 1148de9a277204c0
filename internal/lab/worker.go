package lab

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/internal/crashpoint"
	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/roundtrip"
	"github.com/idemhq/idem/internal/telemetry"
)

// WorkerOptions configure one lab worker process (`idem-lab lab-worker`).
type WorkerOptions struct {
	Approach    string
	AMQPURL     string
	Queue       string
	DatabaseURL string
	RedisURL    string
	Name        string // the connection name
	Prefetch    int
	Workers     int
	TTL         time.Duration
	StatsFile   string
	// Getenv reads IDEM_CRASH_AT and IDEM_CRASH_AFTER, which arm a SIGKILL
	// at AfterCheck or AfterEffect, as they arm `idem consume`.
	Getenv func(string) string
	Logger *slog.Logger
}

// WorkerStats is what a worker writes to its stats file, several times a
// second and right before an armed crash.
type WorkerStats struct {
	Acked     int64 `json:"acked"`     // messages acked: applied or duplicate
	Applied   int64 `json:"applied"`   // effects committed
	Duplicate int64 `json:"duplicate"` // messages dropped as duplicates
	Requeued  int64 `json:"requeued"`  // messages sent back after an error
	PGTrips   int64 `json:"pgTrips"`   // Postgres round trips
	RedisTrip int64 `json:"redisTrips"`
	LastAck   int64 `json:"lastAck"` // unix nanoseconds of the last ack
}

type counters struct {
	acked, applied, duplicate, requeued, pg, redis, lastAck atomic.Int64
}

func (c *counters) snapshot() WorkerStats {
	return WorkerStats{Acked: c.acked.Load(), Applied: c.applied.Load(), Duplicate: c.duplicate.Load(),
		Requeued: c.requeued.Load(), PGTrips: c.pg.Load(), RedisTrip: c.redis.Load(), LastAck: c.lastAck.Load()}
}

// RunWorker consumes the queue with one approach until ctx ends or the
// connection is lost. The same loop serves every approach: prefetch, a
// pool of goroutines, ack after Handle, requeue after an error with a
// backoff.
func RunWorker(ctx context.Context, o WorkerOptions) error {
	var c counters
	writeStats := func() { _ = telemetry.WriteStats(o.StatsFile, c.snapshot()) }
	crash, err := crashpoint.Arm(o.Getenv, []string{AfterCheck, AfterEffect}, writeStats)
	if err != nil {
		return err
	}
	if crash == nil {
		crash = func(string) {}
	}

	pcfg, err := pgxpool.ParseConfig(o.DatabaseURL)
	if err != nil {
		return fmt.Errorf("lab worker: DATABASE_URL: %w", err)
	}
	pcfg.MaxConns = int32(o.Workers + 2)
	pcfg.ConnConfig.Tracer = roundtrip.Postgres(&c.pg)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	ropt, err := redis.ParseURL(o.RedisURL)
	if err != nil {
		return fmt.Errorf("lab worker: REDIS_URL: %w", err)
	}
	ropt.ContextTimeoutEnabled = true // idem's tier needs it; a no-op without deadlines
	rdb := redis.NewClient(ropt)
	rdb.AddHook(roundtrip.Redis(&c.redis))
	defer rdb.Close()
	conn, err := amqp.DialConfig(o.AMQPURL, amqp.Config{Properties: amqp.Table{"connection_name": o.Name}})
	if err != nil {
		return fmt.Errorf("lab worker: dial: %w", err)
	}
	defer conn.Close()
	d := deps{pool: pool, rdb: rdb, ttl: o.TTL, crash: crash, log: o.Logger, conn: conn, queue: o.Queue}
	a, err := newApproach(o.Approach, d)
	if err != nil {
		return err
	}
	if o.Approach == "outbox" {
		if err := runRelay(ctx, d, o.AMQPURL); err != nil {
			return err
		}
	}
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if err := ch.Qos(o.Prefetch, 0, false); err != nil {
		return err
	}
	deliveries, err := ch.Consume(o.Queue, o.Name, false, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("lab worker: consume: %w", err)
	}

	stopStats := telemetry.WriteStatsEvery(o.StatsFile, 100*time.Millisecond, func() any { return c.snapshot() }, nil)
	defer stopStats()

	var wg sync.WaitGroup
	for range o.Workers {
		wg.Go(func() {
			backoff := 50 * time.Millisecond
			for d := range deliveries {
				ev, err := payments.Decode(d.Body)
				if err != nil {
					_ = d.Reject(false) // the lab publishes valid events only
					continue
				}
				out, err := a.Handle(ctx, ev)
				if err != nil {
					c.requeued.Add(1)
					time.Sleep(backoff)
					backoff = min(2*backoff, time.Second)
					_ = d.Nack(false, true)
					continue
				}
				backoff = 50 * time.Millisecond
				if err := d.Ack(false); err != nil {
					continue
				}
				c.acked.Add(1)
				c.lastAck.Store(time.Now().UnixNano())
				if out == "applied" {
					c.applied.Add(1)
				} else {
					c.duplicate.Add(1)
				}
			}
		})
	}
	closed := conn.NotifyClose(make(chan *amqp.Error, 1))
	select {
	case <-ctx.Done():
		_ = ch.Cancel(o.Name, false)
	case err := <-closed:
		wg.Wait()
		return fmt.Errorf("lab worker: connection closed: %v", err)
	}
	wg.Wait()
	return nil
}
