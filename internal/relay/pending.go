package relay

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// pendingByDestination counts the oldest $1 pending rows by destination,
// through the partial index idem_outbox_pending: bounded however long the
// backlog.
const pendingByDestination = `SELECT destination, count(*) FROM (
	SELECT destination FROM idem_outbox WHERE state = 'pending' ORDER BY id LIMIT $1
) p GROUP BY destination`

// PendingDestinations counts db's oldest limit pending rows by their
// destination, and reports whether those were all its pending rows. A
// database without idem_outbox (not migrated yet) has none. It writes
// nothing.
func PendingDestinations(ctx context.Context, db *pgxpool.Pool, limit int) (map[string]int, bool, error) {
	out, n := map[string]int{}, 0
	err := func() error {
		rows, err := db.Query(ctx, pendingByDestination, limit)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var dest string
			var k int
			if err := rows.Scan(&dest, &k); err != nil {
				return err
			}
			out[dest], n = k, n+k
		}
		return rows.Err()
	}()
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P01" { // undefined_table
		return map[string]int{}, true, nil
	} else if err != nil {
		return nil, false, fmt.Errorf("count pending outbox rows: %w", err)
	}
	return out, n < limit, nil
}
