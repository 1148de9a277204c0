package relay

import (
	"context"
	"time"
)

// deleteBatch is how many sent rows one statement deletes: small, so that
// retention never holds locks or writes WAL in bursts that consumers feel.
const deleteBatch = 1000

const deleteExpired = `DELETE FROM idem_outbox WHERE id IN (
	SELECT id FROM idem_outbox WHERE state = 'sent' AND sent_at < now() - $1 * interval '1 millisecond'
	ORDER BY sent_at LIMIT $2 FOR UPDATE SKIP LOCKED)`

// retain deletes rows sent more than Retention ago, every minute, in
// batches of deleteBatch with a pause between them.
func (r *Relay) retain(ctx context.Context) {
	if r.cfg.Retention <= 0 {
		return
	}
	for {
		sleep(ctx, jitter(time.Minute))
		if ctx.Err() != nil {
			return
		}
		n, err := DeleteSent(ctx, r.cfg.DB, r.cfg.Retention)
		if err != nil && ctx.Err() == nil {
			r.log.Warn("delete sent outbox rows", "err", err)
		} else if n > 0 {
			r.log.Debug("deleted sent outbox rows", "rows", n)
		}
	}
}

// DeleteSent deletes the rows sent more than keep ago, deleteBatch at a
// time, and returns how many it deleted.
func DeleteSent(ctx context.Context, db execer, keep time.Duration) (int64, error) {
	var total int64
	for {
		tag, err := db.Exec(ctx, deleteExpired, keep.Milliseconds(), deleteBatch)
		if err != nil {
			return total, err
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < deleteBatch {
			return total, nil
		}
		sleep(ctx, 20*time.Millisecond)
	}
}
