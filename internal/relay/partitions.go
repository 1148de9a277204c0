package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/internal/layout"
	"github.com/idemhq/idem/internal/pgerr"
)

// ErrDestinationPartitions is returned by CheckPartitions when a queue
// destination splits its stream over another number of partitions than the
// stream was set up with.
var ErrDestinationPartitions = errors.New("a queue destination's partition count differs from its stream's")

// CheckPartitions compares the partition count of each queue destination
// (queue:<q>/<n>) with the one db records for the stream q (idem_stream,
// which consumers, idem publish and idem repartition write), and returns
// ErrDestinationPartitions for the first that differs: it would route a
// key's messages to another queue than the stream's publishers do, or to
// one nobody reads. A stream db
// records nothing of (it may live in another database) is not checked. It
// writes nothing.
func CheckPartitions(ctx context.Context, db *pgxpool.Pool, dests map[string]Destination) error {
	for _, name := range Names(dests) {
		d := dests[name]
		if d.Kind != Queue {
			continue
		}
		stream, ok, err := layout.Recorded(ctx, db, d.Stream.Queue)
		if err != nil {
			return fmt.Errorf("destination %s: %w", name, err)
		}
		if n := max(d.Stream.Partitions, 1); ok && stream.Partitions != n {
			return fmt.Errorf("outbox.destinations: %s=%s: %w: the stream %q was set up with %d partition(s) (recorded in idem_stream), and the destination names %d, so it would send a key's messages to another queue than the stream's publishers do, or to one nobody reads. Set it to %s=queue:%s/%d, or, to change the stream's count, drain the stream and run idem repartition --to %d",
				name, d, ErrDestinationPartitions, d.Stream.Queue, stream.Partitions, n, name, d.Stream.Queue, stream.Partitions, n)
		}
	}
	return nil
}

// AwaitPartitions is CheckPartitions at a relay's start: it waits (up to
// timeout, logging, with pgerr.Wait) for a database that is not up yet,
// and returns a mismatch at once, as it is. on names the database in
// logs ("on shard 1"), or is empty.
func AwaitPartitions(ctx context.Context, db *pgxpool.Pool, dests map[string]Destination, timeout time.Duration, on string, log *slog.Logger) error {
	what := "checking the outbox's queue destinations against their streams' partition counts"
	if on != "" {
		what += " " + on
	}
	var mismatch error
	err := pgerr.Wait(ctx, timeout, what, log, func(ctx context.Context) error {
		err := CheckPartitions(ctx, db, dests)
		if errors.Is(err, ErrDestinationPartitions) {
			mismatch = err // not the database's fault: no retry, and said as it is
			return nil
		}
		return err
	})
	if mismatch != nil {
		return mismatch
	}
	return err
}
