package cli

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"

	"github.com/idemhq/idem/internal/config"
	"github.com/idemhq/idem/internal/pgerr"
	"github.com/idemhq/idem/internal/relay"
)

// checkDestinations refuses a queue destination of outbox.destinations
// whose partition count differs from the one a database records for its
// stream (relay.CheckPartitions), on every shard, waiting (up to
// consumer.startup_timeout) for a database that is not up yet. A stream
// no database records is not checked. Then it refuses pending rows to a
// destination outbox.destinations does not name (checkPending).
func checkDestinations(ctx context.Context, cfg config.Config, dbs Shards, log *slog.Logger) error {
	dests := cfg.RelayConfig().Destinations
	for i, pool := range dbs {
		on := ""
		if name := dbs.name(i); name != "" {
			on = "on " + name
		}
		if err := relay.AwaitPartitions(ctx, pool, dests, cfg.Consumer.StartupTimeout, on, log); err != nil {
			return err
		}
	}
	return checkPending(ctx, cfg, dests, dbs, log)
}

// pendingChecked is how many pending outbox rows of each database
// checkPending reads at most: the oldest, which a relay reaches first.
const pendingChecked = 100_000

// checkPending refuses pending outbox rows whose destination
// outbox.destinations does not name, on every shard: a relay would make
// each dead at once. That is a setting to fix (exit 2), and the rows stay
// pending. A row enqueued to such a destination later is dead at once.
func checkPending(ctx context.Context, cfg config.Config, dests map[string]relay.Destination, dbs Shards, log *slog.Logger) error {
	unknown := map[string]int{} // destination ⇒ its pending rows, over the shards
	capped := false
	for i, pool := range dbs {
		what := "checking the pending outbox rows' destinations"
		if name := dbs.name(i); name != "" {
			what += " on " + name
		}
		var pending map[string]int
		var all bool
		err := pgerr.Wait(ctx, cfg.Consumer.StartupTimeout, what, log, func(ctx context.Context) (err error) {
			pending, all, err = relay.PendingDestinations(ctx, pool, pendingChecked)
			return err
		})
		if err != nil {
			return err
		}
		for d, n := range pending {
			if _, ok := dests[d]; !ok {
				unknown[d] += n
			}
		}
		capped = capped || !all
	}
	if len(unknown) == 0 {
		return nil
	}
	var list []string
	for _, d := range slices.Sorted(maps.Keys(unknown)) {
		list = append(list, fmt.Sprintf("%q (%d row(s))", d, unknown[d]))
	}
	among := ""
	if capped {
		among = fmt.Sprintf(" (counted among the oldest %d pending rows of each database)", pendingChecked)
	}
	return configErr(fmt.Errorf("outbox.destinations does not name the destination of pending outbox rows: %s%s. A relay would make each of them dead at once, so it does not start, and they stay pending: add each to outbox.destinations (IDEM_OUTBOX_DESTINATIONS; name=queue:<queue>, name=exchange:<exchange> or name=<http(s) URL>) and start again",
		strings.Join(list, ", "), among))
}
