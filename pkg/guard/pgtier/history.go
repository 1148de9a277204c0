package pgtier

import (
	"fmt"
	"slices"
	"strings"
)

// historyExpr names the history of the dedup rows the session sees: 12 hex
// digits of an MD5 over what changes when the database may have lost
// commits it once acknowledged, or may have been replaced by a copy:
//
//   - the cluster's system identifier: a dump restored into another
//     cluster;
//   - the timeline, the first eight hex digits of the current WAL file's
//     name, which a promotion changes at once (a checkpoint's record of it
//     lags): a failover, a point-in-time or base-backup restore;
//   - when the server started: a file-system snapshot or a cold copy put
//     back, and a crash with fsync off, none of which changes the timeline;
//   - the database's OID: a dump restored into a re-created database of the
//     same cluster (a row restored with the dump would come back with it;
//     the OID does not);
//   - the dedup table's file node: a table dropped and restored, or
//     truncated, under a running server.
//
// Each is read where the claim runs, so no cache can be stale. On a standby
// pg_current_wal_lsn fails, as the claim's INSERT would. The start time is
// read as epoch seconds, which no session setting formats differently.
const historyExpr = `left(md5(concat_ws('/',
	(SELECT system_identifier FROM pg_control_system()),
	left(pg_walfile_name(pg_current_wal_lsn()), 8),
	extract(epoch FROM pg_postmaster_start_time()),
	(SELECT oid FROM pg_database WHERE datname = current_database()),
	pg_relation_filenode(to_regclass('idem_processed')))), 12)`

// historyQuery reads the history alone.
const historyQuery = `SELECT ` + historyExpr

// HistoryParts are the parts of the database's history that a deployment
// may leave out (Options.HistoryWithout), named by the function each
// calls, which some managed services refuse or give another meaning; each
// with what a done marker in Redis is then no longer checked against. A
// left-out part is a constant: an event whose database lost it that way,
// and whose marker Redis still holds, is dropped as a duplicate.
var HistoryParts = map[string]string{
	"pg_control_system":        "a dump restored into another cluster",
	"pg_walfile_name":          "a failover, or a point-in-time or base-backup restore (the timeline)",
	"pg_postmaster_start_time": "a file-system snapshot or a cold copy put back, or a crash with fsync off",
	"pg_relation_filenode":     "idem_processed truncated, or dropped and restored, under a running server",
}

// historyParts are historyExpr's parts in its order, each with the
// function that names it in HistoryParts ("" for one always read).
var historyParts = []struct{ name, sql string }{
	{"pg_control_system", `(SELECT system_identifier FROM pg_control_system())`},
	{"pg_walfile_name", `left(pg_walfile_name(pg_current_wal_lsn()), 8)`},
	{"pg_postmaster_start_time", `extract(epoch FROM pg_postmaster_start_time())`},
	{"", `(SELECT oid FROM pg_database WHERE datname = current_database())`},
	{"pg_relation_filenode", `pg_relation_filenode(to_regclass('idem_processed'))`},
}

// historyWithout is historyExpr with the parts skip names as the constant
// 'off'; with none, it is historyExpr.
func historyWithout(skip []string) (string, error) {
	for _, n := range skip {
		if _, ok := HistoryParts[n]; !ok {
			return "", fmt.Errorf("pgtier: history part %q: want one of pg_control_system, pg_walfile_name, pg_postmaster_start_time, pg_relation_filenode", n)
		}
	}
	if len(skip) == 0 {
		return historyExpr, nil
	}
	parts := make([]string, len(historyParts))
	for i, p := range historyParts {
		parts[i] = p.sql
		if p.name != "" && slices.Contains(skip, p.name) {
			parts[i] = `'off'`
		}
	}
	return "left(md5(concat_ws('/',\n\t" + strings.Join(parts, ",\n\t") + ")), 12)", nil
}
