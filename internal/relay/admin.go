package relay

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

type execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

type queryer interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Message is an outbox row as the tools show it.
type Message struct {
	ID          int64
	MessageID   string
	Scope       string
	EventID     string
	Index       int
	Destination string
	Key         string
	Type        string
	State       string // pending, sent or dead
	Attempts    int
	LastError   string
	CreatedAt   time.Time
	SentAt      *time.Time
	Body        []byte
}

// Filter picks rows for List.
type Filter struct {
	Scope, EventID string // both set: one event's messages
	State          string // "": any
	Limit          int    // 0: 100
}

// List returns the rows f picks, oldest first.
func List(ctx context.Context, db queryer, f Filter) ([]Message, error) {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	rows, err := db.Query(ctx, `SELECT id, scope, event_id, idx, destination, key, type, state, attempts,
		coalesce(last_error, ''), created_at, sent_at, body
	FROM idem_outbox
	WHERE ($1 = '' OR (scope = $1 AND event_id = $2)) AND ($3 = '' OR state = $3)
	ORDER BY id LIMIT $4`, f.Scope, f.EventID, f.State, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("read idem_outbox: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Message, error) {
		var m Message
		err := r.Scan(&m.ID, &m.Scope, &m.EventID, &m.Index, &m.Destination, &m.Key, &m.Type, &m.State, &m.Attempts,
			&m.LastError, &m.CreatedAt, &m.SentAt, &m.Body)
		m.MessageID = MessageID(m.Scope, m.EventID, m.Index)
		return m, err
	})
	if err != nil {
		return nil, fmt.Errorf("read idem_outbox: %w", err)
	}
	return out, nil
}

// Replay makes dead rows pending again with a fresh attempt budget: the
// rows ids names, or every dead row if ids is empty. It returns how many.
func Replay(ctx context.Context, db execer, ids []int64) (int64, error) {
	tag, err := db.Exec(ctx, `UPDATE idem_outbox SET state = 'pending', attempts = 0, next_at = '-infinity'
	WHERE state = 'dead' AND (coalesce(cardinality($1::bigint[]), 0) = 0 OR id = ANY($1))`, ids)
	if err != nil {
		return 0, fmt.Errorf("replay: %w", err)
	}
	return tag.RowsAffected(), nil
}
