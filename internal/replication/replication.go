// Package replication reads a PostgreSQL primary's replication state (its
// standbys, which of them are synchronous, how far each trails) and says
// whether an acknowledged event survives a failover: a commit that an
// asynchronous standby had not received when the primary died is gone from
// the promoted standby, though the consumer acked its event and wrote its
// done marker.
//
// It needs no superuser. A role without pg_monitor (or pg_read_all_stats)
// sees each standby's row in pg_stat_replication but not its state, sync
// state or position; State.Hidden says so, and the verdict then rests on
// synchronous_standby_names alone.
package replication

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Querier is what Read needs of a pool or a connection.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Standby is one row of the primary's pg_stat_replication.
type Standby struct {
	// Name is the standby's application_name (cluster_name, or
	// walreceiver, unless its primary_conninfo names it).
	Name string
	// State is streaming, catchup, startup, backup or stopping; empty when
	// the role may not see it.
	State string
	// SyncState is sync, quorum, potential or async; empty when the role
	// may not see it.
	SyncState string
	// Behind is the WAL the primary has written that the standby has not
	// flushed, in bytes: what a failover to it would lose at most, now.
	// -1 when unknown (hidden from the role, or the standby reported no
	// position yet).
	Behind int64
}

// Synchronous reports whether a commit waits for this standby (or, with
// quorum, for enough of its kind) before it returns.
func (s Standby) Synchronous() bool {
	return s.State == "streaming" && (s.SyncState == "sync" || s.SyncState == "quorum")
}

// State is a database's replication state, as one session of the
// consumer's sees it.
type State struct {
	// InRecovery: the database is a standby itself (read-only).
	InRecovery bool
	// SyncNames is synchronous_standby_names; SyncCommit is
	// synchronous_commit, as the session has it (the server's, the role's
	// or the database's setting).
	SyncNames, SyncCommit string
	// Standbys are those connected to the database now.
	Standbys []Standby
	// Hidden: the session sees the standbys' rows but not their state
	// (the role lacks pg_monitor).
	Hidden bool
}

// query reads everything in one round trip: one row per standby, or one
// row of NULLs without any. pg_current_wal_lsn fails on a standby, so the
// CASE keeps it from running there.
const query = `SELECT pg_is_in_recovery(),
	current_setting('synchronous_standby_names'),
	current_setting('synchronous_commit'),
	r.pid IS NOT NULL,
	coalesce(r.application_name, ''), coalesce(r.state, ''), coalesce(r.sync_state, ''),
	CASE WHEN r.flush_lsn IS NOT NULL AND NOT pg_is_in_recovery()
		THEN pg_wal_lsn_diff(pg_current_wal_lsn(), r.flush_lsn)::bigint END
FROM (SELECT 1) AS one LEFT JOIN pg_stat_replication AS r ON true
ORDER BY r.application_name`

// Read reads db's replication state.
func Read(ctx context.Context, db Querier) (State, error) {
	rows, err := db.Query(ctx, query)
	if err != nil {
		return State{}, fmt.Errorf("read replication state: %w", err)
	}
	defer rows.Close()
	var st State
	for rows.Next() {
		var (
			present bool
			sb      Standby
			behind  *int64
		)
		if err := rows.Scan(&st.InRecovery, &st.SyncNames, &st.SyncCommit, &present, &sb.Name, &sb.State, &sb.SyncState, &behind); err != nil {
			return State{}, fmt.Errorf("read replication state: %w", err)
		}
		if !present {
			continue
		}
		sb.Behind = -1
		if behind != nil {
			sb.Behind = max(*behind, 0)
		}
		if sb.State == "" {
			st.Hidden = true
		}
		st.Standbys = append(st.Standbys, sb)
	}
	if err := rows.Err(); err != nil {
		return State{}, fmt.Errorf("read replication state: %w", err)
	}
	return st, nil
}

// Synchronous counts the standbys a commit waits for.
func (s State) Synchronous() int {
	n := 0
	for _, sb := range s.Standbys {
		if sb.Synchronous() {
			n++
		}
	}
	return n
}

// Behind is the least WAL, in bytes, that a streaming standby lacks: what
// a failover to the closest standby loses at most, now. ok is false when
// no streaming standby reported its position.
func (s State) Behind() (bytes int64, ok bool) {
	for _, sb := range s.Standbys {
		if sb.State == "streaming" && sb.Behind >= 0 && (!ok || sb.Behind < bytes) {
			bytes, ok = sb.Behind, true
		}
	}
	return bytes, ok
}

// Verdict says whether an event acked on this database survives a failover
// (ok), in one sentence for a log line or /readyz.
func (s State) Verdict() (ok bool, text string) {
	n := len(s.Standbys)
	standbys := plural(n, "standby", "standbys")
	switch {
	case s.InRecovery:
		return false, "this database is a standby (in recovery): it cannot commit a claim"
	case s.SyncCommit == "off":
		return false, "synchronous_commit is off: a commit returns before it is on disk, and a crash of the primary can lose an acked event"
	case n == 0:
		return true, "no standby: no failover can lose an acked event (a restore from a backup can: re-send the stream from before the backup)"
	case s.Hidden && s.SyncNames == "":
		return false, fmt.Sprintf("%s, none synchronous (synchronous_standby_names is empty): an acked event can be lost on failover", standbys)
	case s.Hidden:
		return true, fmt.Sprintf("%s; synchronous_standby_names is %q, but this role cannot see which standby is synchronous (grant it pg_monitor)", standbys, s.SyncNames)
	}
	syncs := s.Synchronous()
	switch {
	case syncs == 0 && s.SyncNames == "":
		return false, fmt.Sprintf("%s, none synchronous (synchronous_standby_names is empty): an acked event can be lost on failover", standbys)
	case syncs == 0:
		return false, fmt.Sprintf("%s, none synchronous now though synchronous_standby_names is %q: commits wait until one is", standbys, s.SyncNames)
	case s.SyncCommit == "local":
		return false, fmt.Sprintf("%s, %d synchronous, but synchronous_commit is local: commits do not wait for them, and an acked event can be lost on failover", standbys, syncs)
	}
	return true, fmt.Sprintf("%s, %d synchronous (%s): an acked event survives a failover to a synchronous standby", standbys, syncs, names(s.Standbys))
}

// names lists the synchronous standbys.
func names(sbs []Standby) string {
	var out []string
	for _, sb := range sbs {
		if sb.Synchronous() {
			out = append(out, sb.Name)
		}
	}
	return strings.Join(out, ", ")
}

func plural(n int, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return fmt.Sprintf("%d %s", n, many)
}
