package pgtier

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/pkg/guard"
)

// Store is the PostgreSQL tier. It is safe for concurrent use.
type Store struct {
	pool *pgxpool.Pool
}

var _ guard.Store = (*Store)(nil)

// New returns a Store over pool. The pool's search_path must reach the
// idem_processed table created by the migrations.
func New(pool *pgxpool.Pool) *Store { return &Store{pool: pool} }

// Begin starts a READ COMMITTED transaction.
func (s *Store) Begin(ctx context.Context) (pgx.Tx, error) {
	return s.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
}

const claimOne = `INSERT INTO idem_processed (scope, event_id, payload_hash)
VALUES ($1, $2, $3) ON CONFLICT DO NOTHING`

const claimMany = `INSERT INTO idem_processed (scope, event_id, payload_hash)
SELECT $1, id, hash FROM unnest($2::text[], $3::bytea[]) AS t(id, hash)
ON CONFLICT DO NOTHING RETURNING event_id`

const lookup = `SELECT event_id, payload_hash FROM idem_processed
WHERE scope = $1 AND event_id = ANY($2::text[])`

// Claim inserts a dedup row for each event inside tx. An event whose row
// already exists is ClaimDuplicate if the stored payload hash matches and
// ClaimConflict if it does not. The common case (one new event) is one
// statement; only duplicates cost a second one.
func (s *Store) Claim(ctx context.Context, tx pgx.Tx, scope string, events []guard.Event) ([]guard.ClaimResult, error) {
	out := make([]guard.ClaimResult, len(events))
	if len(events) == 1 {
		tag, err := tx.Exec(ctx, claimOne, scope, events[0].ID, events[0].Hash)
		if err != nil {
			return nil, fmt.Errorf("insert dedup row: %w", err)
		}
		if tag.RowsAffected() == 1 {
			out[0] = guard.ClaimInserted
			return out, nil
		}
	} else {
		ids := make([]string, len(events))
		hashes := make([][]byte, len(events))
		for i, ev := range events {
			ids[i], hashes[i] = ev.ID, ev.Hash
		}
		rows, err := tx.Query(ctx, claimMany, scope, ids, hashes)
		if err != nil {
			return nil, fmt.Errorf("insert dedup rows: %w", err)
		}
		inserted, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return nil, fmt.Errorf("insert dedup rows: %w", err)
		}
		mine := make(map[string]bool, len(inserted))
		for _, id := range inserted {
			mine[id] = true
		}
		for i, ev := range events {
			if mine[ev.ID] {
				out[i] = guard.ClaimInserted
				delete(mine, ev.ID) // a second copy in the same batch is a duplicate
			}
		}
	}
	return out, s.resolveExisting(ctx, tx, scope, events, out)
}

// resolveExisting fills in the results of events whose row already existed.
// It runs as a new statement, so under READ COMMITTED it sees the row that a
// concurrent transaction committed while our INSERT waited on it.
func (s *Store) resolveExisting(ctx context.Context, tx pgx.Tx, scope string, events []guard.Event, out []guard.ClaimResult) error {
	var ids []string
	for i, ev := range events {
		if out[i] == 0 {
			ids = append(ids, ev.ID)
		}
	}
	if len(ids) == 0 {
		return nil
	}
	rows, err := tx.Query(ctx, lookup, scope, ids)
	if err != nil {
		return fmt.Errorf("look up dedup rows: %w", err)
	}
	stored := map[string][]byte{}
	var id string
	var hash []byte
	_, err = pgx.ForEachRow(rows, []any{&id, &hash}, func() error {
		stored[id] = bytes.Clone(hash)
		return nil
	})
	if err != nil {
		return fmt.Errorf("look up dedup rows: %w", err)
	}
	for i, ev := range events {
		if out[i] != 0 {
			continue
		}
		h, ok := stored[ev.ID]
		switch {
		case !ok:
			// The conflicting row vanished between the two statements: only
			// a prune of an expired row can do that.
			return errors.New("dedup row disappeared during claim (pruned concurrently?)")
		case bytes.Equal(h, ev.Hash):
			out[i] = guard.ClaimDuplicate
		default:
			out[i] = guard.ClaimConflict
		}
	}
	return nil
}

// Prune deletes dedup rows processed more than retention ago, in batches of
// batch rows, and returns how many it deleted. Events older than retention
// must be refused by the consumer (it compares the publish timestamp), or a
// redelivery of a pruned event would be processed again.
func (s *Store) Prune(ctx context.Context, retention time.Duration, batch int) (int64, error) {
	if retention <= 0 {
		return 0, fmt.Errorf("prune: retention must be positive, got %s", retention)
	}
	var total int64
	for {
		tag, err := s.pool.Exec(ctx, `DELETE FROM idem_processed WHERE ctid = ANY (ARRAY(
			SELECT ctid FROM idem_processed WHERE processed_at < now() - $1::interval LIMIT $2))`,
			retention, batch)
		if err != nil {
			return total, fmt.Errorf("prune: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batch) {
			return total, nil
		}
	}
}
