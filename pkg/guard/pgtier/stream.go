package pgtier

import (
	"context"
	"errors"
	"fmt"
)

// ErrWrongPartitions is returned by CheckPartitions when the stream was set
// up with another partition count.
var ErrWrongPartitions = errors.New("the stream was set up with another partition count")

// StreamLayout is what the database records of a stream (idem_stream).
type StreamLayout struct {
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
func (s *Store) CheckPartitions(ctx context.Context, queue string, partitions int) (StreamLayout, error) {
	partitions = max(partitions, 1)
	// DO UPDATE, not DO NOTHING, as in CheckShard: it waits for a first
	// recorder that has not committed and returns its row.
	var l StreamLayout
	var prev *int
	err := s.pool.QueryRow(ctx, `INSERT INTO idem_stream (queue, partitions) VALUES ($1, $2)
		ON CONFLICT (queue) DO UPDATE SET partitions = idem_stream.partitions
		RETURNING partitions, previous`, queue, partitions).Scan(&l.Partitions, &prev)
	if err != nil {
		return StreamLayout{}, fmt.Errorf("check partitions: %w", err)
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
func (s *Store) SetPartitions(ctx context.Context, queue string, partitions int) (StreamLayout, error) {
	partitions = max(partitions, 1)
	var l StreamLayout
	var prev *int
	err := s.pool.QueryRow(ctx, `INSERT INTO idem_stream (queue, partitions) VALUES ($1, $2)
		ON CONFLICT (queue) DO UPDATE SET
			previous = CASE WHEN idem_stream.partitions = EXCLUDED.partitions THEN idem_stream.previous ELSE idem_stream.partitions END,
			partitions = EXCLUDED.partitions, changed_at = now()
		RETURNING partitions, previous`, queue, partitions).Scan(&l.Partitions, &prev)
	if err != nil {
		return StreamLayout{}, fmt.Errorf("set partitions: %w", err)
	}
	if prev != nil {
		l.Previous = *prev
	}
	return l, nil
}
