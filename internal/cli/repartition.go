package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/config"
	"github.com/idemhq/idem/internal/layout"
	"github.com/idemhq/idem/internal/pgerr"
	"github.com/idemhq/idem/internal/pgsession"
	"github.com/idemhq/idem/migrations"
)

// checkPartitions compares cfg's partition count with the one the database
// records for the stream (recording it if none is), on every shard, waiting
// (up to consumer.startup_timeout) for a database that is not up yet. With
// migrate it applies the guard's migrations first (idem's own tables only;
// they are locked against concurrent runs), so that a publisher may start
// before the first consumer; without, it refuses a database they are
// missing in (idem publish --no-migrate, for a role that may not create).
func checkPartitions(ctx context.Context, cfg config.Config, log *slog.Logger, migrate bool) error {
	dbs, err := OpenShards(ctx, cfg, pgsession.Bounds{})
	if err != nil {
		return err
	}
	defer dbs.Close()
	if !migrate {
		if err := requireMigrated(ctx, cfg, dbs, log, migrations.Guard); err != nil {
			return err
		}
	}
	for i, pool := range dbs {
		what := "checking the stream's partition count (partitions)"
		if name := dbs.name(i); name != "" {
			what += " on " + name
		}
		err := pgerr.Wait(ctx, cfg.Consumer.StartupTimeout, what, log, func(ctx context.Context) error {
			if migrate {
				if _, err := migrations.Apply(ctx, pool); err != nil {
					return err
				}
			}
			_, err := layout.CheckPartitions(ctx, pool, cfg.Queue, cfg.Partitions)
			return err
		})
		if err != nil {
			return err
		}
	}
	return nil
}

func runRepartition(ctx context.Context, e *Env, args []string) error {
	fs := NewFlags(e, "repartition", `Changes how many partition queues the stream is split over, as recorded in
the database, where consumers and idem publish check it at start. It refuses
while any queue of the current layout holds messages or has a consumer:

  1. stop the publishers, and let the consumers drain the queues;
  2. stop the consumers;
  3. idem repartition --to N;
  4. start consumers and publishers with partitions: N (IDEM_PARTITIONS).

Consumers then watch the old layout's queues and report any message a
stale publisher strands there (log, idem_stranded_messages, /readyz).`)
	path := fs.String("config", "", "YAML config `file`")
	e.targetFlags(fs, false, true)
	to := fs.Int("to", 0, "the new partition count `N` (1: one queue)")
	if err := Parse(fs, args); err != nil {
		return err
	}
	if *to < 1 {
		return UsageErr(e, "idem repartition: --to N is required, N at least 1")
	}
	cfg, _, dbs, err := e.LoadDB(ctx, *path)
	if err != nil {
		return err
	}
	defer dbs.Close()
	// The layout in force is the recorded one (the config's, if none is);
	// a config that differs from it is what a repartition expects.
	stream, err := layout.CheckPartitions(ctx, dbs[0], cfg.Queue, cfg.Partitions)
	if err != nil && !errors.Is(err, layout.ErrWrongPartitions) {
		return unmigrated(err)
	}
	if stream.Partitions == *to {
		fmt.Fprintf(e.Stdout, "%s already has %d partition(s)\n", cfg.Queue, *to)
		return nil
	}
	old := cfg.Topology()
	old.Partitions = stream.Partitions
	busy, err := busyQueues(ctx, cfg.AMQPURL, old.Queues())
	if err != nil {
		return fmt.Errorf("amqp_url: %w", err)
	}
	if len(busy) > 0 {
		return fmt.Errorf("repartition: the queues of the current layout (%d partition(s)) are not idle: %s. Stop the publishers, let the consumers drain them, stop the consumers, then run this again",
			stream.Partitions, strings.Join(busy, "; "))
	}
	for i, pool := range dbs {
		if _, err := layout.SetPartitions(ctx, pool, cfg.Queue, *to); err != nil {
			return fmt.Errorf("shard %d: %w", i, err)
		}
	}
	fmt.Fprintf(e.Stdout, "%s: %d partition(s) → %d. Start consumers and publishers with partitions: %d (IDEM_PARTITIONS=%d)\n",
		cfg.Queue, stream.Partitions, *to, *to, *to)
	return nil
}

// busyQueues describes each of queues that holds messages or has a
// consumer; a queue that does not exist is idle.
func busyQueues(ctx context.Context, url string, queues []string) ([]string, error) {
	conn, _, err := broker.DialContext(ctx, broker.SplitURLs(url), 0, amqp.Config{Properties: amqp.Table{"connection_name": "idem-repartition"}})
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	var busy []string
	for _, q := range queues {
		ch, err := conn.Channel() // a passive declare of a missing queue closes its channel
		if err != nil {
			return nil, err
		}
		info, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
		if err == nil && (info.Messages > 0 || info.Consumers > 0) {
			busy = append(busy, fmt.Sprintf("%s: %d message(s), %d consumer(s)", q, info.Messages, info.Consumers))
		}
		if !ch.IsClosed() {
			ch.Close()
		}
	}
	return busy, nil
}
