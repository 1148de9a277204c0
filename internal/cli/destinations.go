package cli

import (
	"context"
	"errors"
	"log/slog"

	"github.com/idemhq/idem/internal/config"
	"github.com/idemhq/idem/internal/pgerr"
	"github.com/idemhq/idem/internal/relay"
)

// checkDestinations refuses a queue destination of outbox.destinations
// whose partition count differs from the one a database records for its
// stream (relay.CheckPartitions), on every shard, waiting (up to
// consumer.startup_timeout) for a database that is not up yet. A stream
// no database records is not checked.
func checkDestinations(ctx context.Context, cfg config.Config, dbs Shards, log *slog.Logger) error {
	dests := cfg.RelayConfig().Destinations
	for i, pool := range dbs {
		what := "checking the outbox's queue destinations against their streams' partition counts"
		if name := dbs.name(i); name != "" {
			what += " on " + name
		}
		var mismatch error
		err := pgerr.Wait(ctx, cfg.Consumer.StartupTimeout, what, log, func(ctx context.Context) error {
			err := relay.CheckPartitions(ctx, pool, dests)
			if errors.Is(err, relay.ErrDestinationPartitions) {
				mismatch = err // not the database's fault: no retry, and said as it is
				return nil
			}
			return err
		})
		if mismatch != nil {
			return mismatch
		}
		if err != nil {
			return err
		}
	}
	return nil
}
