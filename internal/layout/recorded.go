package layout

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Recorded returns what db records of queue's stream, and false if it
// records nothing: no row, or no idem_stream table yet (a database the
// migrations have not reached). Unlike CheckPartitions it writes nothing,
// for a process that sends to a stream without being one of its publishers
// of record (a relay).
func Recorded(ctx context.Context, db *pgxpool.Pool, queue string) (Stream, bool, error) {
	var l Stream
	var prev *int
	err := db.QueryRow(ctx, `SELECT partitions, previous FROM idem_stream WHERE queue = $1`, queue).Scan(&l.Partitions, &prev)
	var pgErr *pgconn.PgError
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return Stream{}, false, nil
	case errors.As(err, &pgErr) && pgErr.Code == "42P01": // undefined_table
		return Stream{}, false, nil
	case err != nil:
		return Stream{}, false, fmt.Errorf("read partitions: %w", err)
	}
	if prev != nil {
		l.Previous = *prev
	}
	return l, true, nil
}
