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

// Filter picks rows for List and Replay; an empty field picks any.
type Filter struct {
	Scope       string
	EventID     string // with Scope: one event's messages
	Destination string
	State       string // pending, sent or dead (Replay: dead only)
	IDs         []int64
	Limit       int // List: 0 is 100
}

// States are the states an outbox row can be in.
var States = []string{"pending", "sent", "dead"}

// List returns the rows f picks, oldest first.
func List(ctx context.Context, db queryer, f Filter) ([]Message, error) {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	rows, err := db.Query(ctx, `SELECT id, scope, event_id, idx, destination, key, type, state, attempts,
		coalesce(last_error, ''), created_at, sent_at, body
	FROM idem_outbox
	WHERE `+filterWhere+`
	ORDER BY id LIMIT $6`, f.Scope, f.EventID, f.Destination, f.State, f.IDs, f.Limit)
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
	return ReplayWhere(ctx, db, Filter{IDs: ids})
}

// filterWhere is the condition a Filter's fields ($1 to $5) make.
const filterWhere = `($1 = '' OR scope = $1) AND ($2 = '' OR event_id = $2) AND ($3 = '' OR destination = $3)
	AND ($4 = '' OR state = $4) AND (coalesce(cardinality($5::bigint[]), 0) = 0 OR id = ANY($5))`

// ReplayWhere is Replay for the dead rows f picks (f.State and f.Limit
// are not used).
func ReplayWhere(ctx context.Context, db execer, f Filter) (int64, error) {
	tag, err := db.Exec(ctx, `UPDATE idem_outbox SET state = 'pending', attempts = 0, next_at = '-infinity'
	WHERE state = 'dead' AND `+filterWhere, f.Scope, f.EventID, f.Destination, "", f.IDs)
	if err != nil {
		return 0, fmt.Errorf("replay: %w", err)
	}
	return tag.RowsAffected(), nil
}

// Since is where a resend's window starts: At, or Back before the
// database's clock (which stamped sent_at) when Back is set.
type Since struct {
	At   time.Time
	Back time.Duration
}

type beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Resend makes sent rows pending again with a fresh attempt budget: the rows
// of f.Destination (which it requires) sent within since that f picks
// (f.State is not used). It is for messages lost after their destination
// took them: a queue deleted with its messages in it, a receiver restored
// from a backup. The relay sends them again with their original message IDs
// (and Idempotency-Keys), so a receiver that still has one drops it as a
// duplicate. Rows deleted after outbox.retention are not resent. It locks
// every lane first, so a relay pass under way (one that published a row
// and has not marked it sent yet) ends before the rows are read. With
// dryRun it only counts them.
func Resend(ctx context.Context, db beginner, f Filter, since Since, dryRun bool) (int64, error) {
	if f.Destination == "" {
		return 0, fmt.Errorf("resend: no destination")
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("resend: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	window := `sent_at >= CASE WHEN $7::bigint > 0 THEN now() - $7 * interval '1 millisecond' ELSE $6::timestamptz END`
	args := []any{f.Scope, f.EventID, f.Destination, "", f.IDs, since.At, since.Back.Milliseconds()}
	var n int64
	if dryRun {
		err = tx.QueryRow(ctx, `SELECT count(*) FROM idem_outbox WHERE state = 'sent' AND `+window+` AND `+filterWhere, args...).Scan(&n)
	} else {
		if _, err = tx.Exec(ctx, `SELECT lane FROM idem_outbox_lane ORDER BY lane FOR UPDATE`); err == nil {
			var tag pgconn.CommandTag
			tag, err = tx.Exec(ctx, `UPDATE idem_outbox SET state = 'pending', attempts = 0, next_at = '-infinity', last_error = NULL
			WHERE state = 'sent' AND `+window+` AND `+filterWhere, args...)
			n = tag.RowsAffected()
		}
		if err == nil {
			err = tx.Commit(ctx)
		}
	}
	if err != nil {
		return 0, fmt.Errorf("resend: %w", err)
	}
	return n, nil
}
