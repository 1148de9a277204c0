// Package layout keeps what an authoritative database records of where
// it stands: its place among the shards (idem_shard) and the partition
// count of each stream (idem_stream). Consumers and publishers check both
// at start, so that a reordered shard list or a publisher with another
// partition count is refused instead of losing events. A process that
// does not migrate at start also checks that its migration sets are
// applied (CheckMigrated).
package layout

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/internal/pgerr"
)

// ErrWrongPartitions is returned by CheckPartitions when the stream was set
// up with another partition count.
var ErrWrongPartitions = errors.New("the stream was set up with another partition count")

// Stream is what the database records of a stream (idem_stream).
type Stream struct {
	// Partitions is how many partition queues the stream is split over (1:
	// one queue).
	Partitions int
	// Previous is the count before the last change, 0 if it never changed:
	// its queues may still hold messages a stale publisher sent.
	Previous int
}

// CheckPartitions records that queue's stream is split over partitions
// queues (0 and 1 both mean one queue), or, if a count was recorded before,
// returns ErrWrongPartitions unless it is the same. Consumers and publishers
// call it at start: a publisher and consumers that disagree strand the
// events routed to queues nobody reads.
func CheckPartitions(ctx context.Context, db *pgxpool.Pool, queue string, partitions int) (Stream, error) {
	partitions = max(partitions, 1)
	// DO UPDATE, not DO NOTHING, as in CheckShard: it waits for a first
	// recorder that has not committed and returns its row.
	var l Stream
	var prev *int
	err := db.QueryRow(ctx, `INSERT INTO idem_stream (queue, partitions) VALUES ($1, $2)
		ON CONFLICT (queue) DO UPDATE SET partitions = idem_stream.partitions
		RETURNING partitions, previous`, queue, partitions).Scan(&l.Partitions, &prev)
	if err != nil {
		return Stream{}, fmt.Errorf("check partitions: %w", err)
	}
	if prev != nil {
		l.Previous = *prev
	}
	if l.Partitions != partitions {
		return l, fmt.Errorf("%w: %q was set up with %d partition(s), and this process is configured with %d (the partitions setting, IDEM_PARTITIONS); to change the count, drain the stream and run idem repartition",
			ErrWrongPartitions, queue, l.Partitions, partitions)
	}
	return l, nil
}

// SetPartitions changes the recorded partition count of queue's stream, and
// keeps the one before as Previous. The caller makes sure the old queues
// are empty first (idem repartition does).
func SetPartitions(ctx context.Context, db *pgxpool.Pool, queue string, partitions int) (Stream, error) {
	partitions = max(partitions, 1)
	var l Stream
	var prev *int
	err := db.QueryRow(ctx, `INSERT INTO idem_stream (queue, partitions) VALUES ($1, $2)
		ON CONFLICT (queue) DO UPDATE SET
			previous = CASE WHEN idem_stream.partitions = EXCLUDED.partitions THEN idem_stream.previous ELSE idem_stream.partitions END,
			partitions = EXCLUDED.partitions, changed_at = now()
		RETURNING partitions, previous`, queue, partitions).Scan(&l.Partitions, &prev)
	if err != nil {
		return Stream{}, fmt.Errorf("set partitions: %w", err)
	}
	if prev != nil {
		l.Previous = *prev
	}
	return l, nil
}

// ErrWrongShard is returned by CheckShard when the database was recorded as
// another shard, or as a shard of another number of shards.
var ErrWrongShard = errors.New("database holds another shard")

// ErrNotMigrated is returned by CheckShard, the first of the start-up
// checks, when idem's tables are not there.
var ErrNotMigrated = errors.New("idem's tables are missing in this database (in the first schema of its search_path): run `idem migrate`, or set Migrate in idem.Config")

// CheckShard records that this database is shard shard of shards, or, if a
// place was recorded before, returns ErrWrongShard unless it is the same.
// Call it at start: a reordered or resized shard list would route keys to
// databases that do not hold their dedup history.
func CheckShard(ctx context.Context, db *pgxpool.Pool, shard, shards int) error {
	if shard < 0 || shard >= shards {
		return fmt.Errorf("check shard: want 0 <= shard < shards, got %d of %d", shard, shards)
	}
	// DO UPDATE, not DO NOTHING: the statement then waits for a first
	// recorder that has not committed yet and returns the row it wrote. (A
	// SELECT beside DO NOTHING reads the statement's snapshot, taken before
	// that commit, and finds no row.) The update keeps the stored values.
	var was, of int
	err := db.QueryRow(ctx, `INSERT INTO idem_shard (shard, shards) VALUES ($1, $2)
		ON CONFLICT (id) DO UPDATE SET shard = idem_shard.shard
		RETURNING shard, shards`, shard, shards).Scan(&was, &of)
	if pgerr.SQLState(err) == pgerr.UndefinedTable {
		return fmt.Errorf("%w (%w)", ErrNotMigrated, err)
	}
	if err != nil {
		return fmt.Errorf("check shard: %w", err)
	}
	if was != shard || of != shards {
		return fmt.Errorf("%w: it was set up as shard %d of %d, and is now listed as shard %d of %d", ErrWrongShard, was, of, shard, shards)
	}
	return nil
}
