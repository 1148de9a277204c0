package pgtier

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/guard"
)

// releasedHistory is the history as the release before this one wrote it
// (every part read in full, the database's OID from the catalog), with the
// parts skip names as 'off': markers written by either release must be
// confirmed by the other, so the value may not change.
func releasedHistory(skip []string) string {
	parts := []struct{ name, sql string }{
		{"pg_control_system", `(SELECT system_identifier FROM pg_control_system())`},
		{"pg_walfile_name", `left(pg_walfile_name(pg_current_wal_lsn()), 8)`},
		{"pg_postmaster_start_time", `extract(epoch FROM pg_postmaster_start_time())`},
		{"", `(SELECT oid FROM pg_database WHERE datname = current_database())`},
		{"pg_relation_filenode", `pg_relation_filenode(to_regclass('idem_processed'))`},
	}
	sql := make([]string, len(parts))
	for i, p := range parts {
		sql[i] = p.sql
		for _, s := range skip {
			if s == p.name {
				sql[i] = `'off'`
			}
		}
	}
	return `SELECT left(md5(concat_ws('/', ` + strings.Join(sql, ", ") + `)), 12)`
}

// id names the j-th event of the i-th case.
func id(i, j int) string { return fmt.Sprintf("evt_%d_%d", i, j) }

// claimOnce claims a new event on s, commits, and returns the history the
// claim reported.
func claimOnce(t *testing.T, s *Store, id string) string {
	t.Helper()
	ctx := context.Background()
	tx, err := s.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	_, h, err := s.Claim(ctx, tx, "svc", []guard.Event{{ID: id, Hash: guard.HashFields(id)}})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	return string(h)
}

// TestTheHistoryKeepsItsValue: the history a Store reads, alone and in
// claims (the first, which reads the system identifier, and the next, which
// keeps it), is the value the release before this one computed, with every
// part and with each part left out; and the expression written out is the
// one historyOf builds.
func TestTheHistoryKeepsItsValue(t *testing.T) {
	t.Parallel()
	require.Equal(t, historyExpr, historyOf(nil, sysidPart, startPart))
	pool, _ := testenv.Schema(t)
	ctx := context.Background()
	for i, skip := range [][]string{nil, {"pg_control_system"}, {"pg_walfile_name"}, {"pg_postmaster_start_time"},
		{"pg_relation_filenode"}, {"pg_control_system", "pg_relation_filenode"}} {
		var want string
		require.NoError(t, pool.QueryRow(ctx, releasedHistory(skip)).Scan(&want))
		s, err := NewWith(pool, Options{HistoryWithout: skip})
		require.NoError(t, err)
		h, err := s.History(ctx)
		require.NoError(t, err)
		require.Equal(t, want, string(h), "History, without %v", skip)
		for j := range 3 {
			require.Equal(t, want, claimOnce(t, s, id(i, j)), "claim %d, without %v", j, skip)
		}
		if keeps(skip) {
			require.NotNil(t, s.claim.Load().key, "no identifier kept, without %v", skip)
			require.Equal(t, want, claimOnce(t, s, id(i, 9)), "a claim with the identifier kept, without %v", skip)
		} else {
			require.Nil(t, s.claim.Load().key, "an identifier kept, without %v", skip)
		}
	}

	// A partitioned dedup table has no file of its own: the database's OID
	// still counts (it is read from pg_class's file path, not the table's).
	_, err := pool.Exec(ctx, `ALTER TABLE idem_processed RENAME TO idem_processed_flat;
		CREATE TABLE idem_processed (event_id text) PARTITION BY HASH (event_id)`)
	require.NoError(t, err)
	var want, withoutDB string
	require.NoError(t, pool.QueryRow(ctx, releasedHistory(nil)).Scan(&want))
	require.NoError(t, pool.QueryRow(ctx, `SELECT left(md5(concat_ws('/', (SELECT system_identifier FROM pg_control_system()),
		left(pg_walfile_name(pg_current_wal_lsn()), 8), extract(epoch FROM pg_postmaster_start_time()))), 12)`).Scan(&withoutDB))
	require.NotEqual(t, withoutDB, want, "the database's OID left the history of a partitioned table")
	s, err := NewWith(pool, Options{})
	require.NoError(t, err)
	h, err := s.History(ctx)
	require.NoError(t, err)
	require.Equal(t, want, string(h), "History, a partitioned idem_processed")
}

// TestAClaimTakesTheKeptIdentifierOnlyForItsStart: once a Store keeps the
// system identifier its claims read, a claim on a server with the kept
// start time takes the identifier kept, not the control file's (a Store
// made to keep a wrong one for this start time shows it: its claims
// report another history); a claim on a server of another start time (as
// after a failover, or a restore into another cluster) reads the control
// file, reports the server's history, and the Store keeps the server's
// identifier again. Only numbers go into the statement.
func TestAClaimTakesTheKeptIdentifierOnlyForItsStart(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t)
	ctx := context.Background()
	s := New(pool)
	want, err := s.History(ctx)
	require.NoError(t, err)
	require.Equal(t, string(want), claimOnce(t, s, "a"))
	var real sysKey
	require.NoError(t, pool.QueryRow(ctx, `SELECT `+startPart+`, `+sysidPart).Scan(&real.start, &real.sysid))
	require.Equal(t, real, *s.claim.Load().key)
	require.Equal(t, string(want), claimOnce(t, s, "b"))

	s.keep(sysKey{start: real.start, sysid: "42"})
	require.NotEqual(t, string(want), claimOnce(t, s, "c"), "the claim read the control file for the kept start time")
	require.Equal(t, "42", s.claim.Load().key.sysid, "a claim that took the kept identifier learned another")

	s.keep(sysKey{start: "1", sysid: "42"}) // another server's
	require.Equal(t, string(want), claimOnce(t, s, "d"), "the server's history, not the kept identifier's")
	require.Equal(t, real, *s.claim.Load().key, "the server's identifier not kept again")

	s.keep(sysKey{start: "1'; DROP TABLE idem_processed; --", sysid: "42"})
	require.NotContains(t, s.claim.Load().sql, "DROP TABLE", "a value that is not a number went into the statement")
	require.Equal(t, string(want), claimOnce(t, s, "e"))
	require.Equal(t, real, *s.claim.Load().key)

	// A read of the history that finds another identifier under the kept
	// start time (a start time that does not tell servers apart) ends the
	// keeping for good: every claim reads the control file.
	h, err := s.History(ctx)
	require.NoError(t, err)
	require.Equal(t, want, h)
	require.Equal(t, real, *s.claim.Load().key, "a read that agrees ended the keeping")
	s.keep(sysKey{start: real.start, sysid: "42"})
	h, err = s.History(ctx)
	require.NoError(t, err)
	require.Equal(t, want, h)
	require.Nil(t, s.claim.Load().key, "the keeping went on after another identifier under its start time")
	require.NotContains(t, s.claim.Load().sql, "'42'")
	for _, ev := range []string{"f", "g"} {
		require.Equal(t, string(want), claimOnce(t, s, ev))
		require.Nil(t, s.claim.Load().key, "an identifier kept again")
	}
}

// TestAStoreWithoutMarkersClaimsWithoutTheHistory: a Store made with
// NoMarkers claims without reading the history (its claims report none)
// and still reads it alone.
func TestAStoreWithoutMarkersClaimsWithoutTheHistory(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.Schema(t)
	ctx := context.Background()
	s, err := NewWith(pool, Options{NoMarkers: true})
	require.NoError(t, err)
	require.Equal(t, "", claimOnce(t, s, "a"))
	require.NotContains(t, s.claim.Load().sql, "pg_control_system")
	h, err := s.History(ctx)
	require.NoError(t, err)
	require.Regexp(t, `^[0-9a-f]{12}$`, string(h))
	require.Nil(t, s.claim.Load().key)
}

// TestAKeepRacingACheckNeverKeepsAgain: check ends the keeping for good,
// even when a claim's keep runs beside it. Without the lock, a keep that
// saw unkept false stored its keyed statement after check's unkeyed one,
// a few iterations in. No database: neither touches the pool.
func TestAKeepRacingACheckNeverKeepsAgain(t *testing.T) {
	kept := sysKey{start: "1", sysid: "100"}
	other := sysKey{start: "1", sysid: "200"} // a read: another identifier under the kept start
	next := sysKey{start: "2", sysid: "300"}  // a claim that read the control file
	for i := range 2000 {
		s, err := NewWith(nil, Options{})
		require.NoError(t, err)
		s.keep(kept)
		var wg sync.WaitGroup
		start := make(chan struct{})
		wg.Add(2)
		go func() { defer wg.Done(); <-start; s.check(other) }()
		go func() { defer wg.Done(); <-start; s.keep(next) }()
		close(start)
		wg.Wait()
		if s.unkept.Load() {
			require.Nil(t, s.claim.Load().key, "iteration %d: the keeping ended, yet the claim keeps an identifier", i)
		}
	}
}
