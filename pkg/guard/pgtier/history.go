package pgtier

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
)

// The database's history is 12 hex digits of an MD5 over what changes when
// the database may have lost commits it once acknowledged, or may have been
// replaced by a copy:
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
// Each is read where the claim runs, so no cache can be stale, with one
// exception that reads the same value: the system identifier, a read of the
// control file from disk, is taken from what the Store read last while the
// server's start time is the one read with it (see historyCTE). A running
// server cannot change its system identifier, and two servers that answer
// with the same start time, to the microsecond, are one server, or a copy
// of a running one, which has its identifier too (docs/guard.md). Without
// the start time (HistoryWithout) the identifier is read every time.
//
// The database's OID is read from pg_class's file path (base/OID/NODE, or
// pg_tblspc/SPACE/VERSION/OID/NODE in a database with a tablespace of its
// own), a function call, rather than from pg_database, a catalog scan the
// executor opens on every call. pg_class is in every database and always
// has a file. (A partitioned dedup table has no file node, so the history
// could not see it truncated or restored: idem refuses one at start,
// layout.ErrPartitionedDedupTable.) Without the
// file node (HistoryWithout), which leaves out pg_relation_filepath with
// it, the OID is read from the catalog.
// On a standby pg_current_wal_lsn fails, as the claim's INSERT would. The
// start time is read as epoch seconds, which no session setting formats
// differently. Every part is the text its type prints, so the value is the
// one earlier releases computed (TestTheHistoryKeepsItsValue).
const (
	sysidPart    = `(pg_control_system()).system_identifier::text`
	timelinePart = `left(pg_walfile_name(pg_current_wal_lsn()), 8)`
	startPart    = `extract(epoch FROM pg_postmaster_start_time())::text`
	dbCatalog    = `(SELECT oid FROM pg_database WHERE datname = current_database())::text`
	dbPathPart   = `split_part(pg_relation_filepath('pg_catalog.pg_class'), '/', -2)`
	filenodePart = `pg_relation_filenode(to_regclass('idem_processed'))`
)

// historyExpr is the history with every part read: historyOf(nil,
// sysidPart, startPart), written out.
const historyExpr = `left(md5(concat_ws('/',
	` + sysidPart + `,
	` + timelinePart + `,
	` + startPart + `,
	` + dbPathPart + `,
	` + filenodePart + `)), 12)`

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

// checkParts refuses a name HistoryParts lacks.
func checkParts(skip []string) error {
	for _, n := range skip {
		if _, ok := HistoryParts[n]; !ok {
			return fmt.Errorf("pgtier: history part %q: want one of pg_control_system, pg_walfile_name, pg_postmaster_start_time, pg_relation_filenode", n)
		}
	}
	return nil
}

// historyOf is the history expression with the parts skip names as the
// constant 'off', and sysid and start as the SQL of the system identifier
// and of the start time. Without the file node the database's OID comes
// from the catalog: the file path is the file node's too.
func historyOf(skip []string, sysid, start string) string {
	part := func(name, sql string) string {
		if slices.Contains(skip, name) {
			return `'off'`
		}
		return sql
	}
	db := dbPathPart
	if slices.Contains(skip, "pg_relation_filenode") {
		db = dbCatalog
	}
	return "left(md5(concat_ws('/',\n\t" + strings.Join([]string{
		part("pg_control_system", sysid),
		part("pg_walfile_name", timelinePart),
		part("pg_postmaster_start_time", start),
		db,
		part("pg_relation_filenode", filenodePart),
	}, ",\n\t") + ")), 12)"
}

// sysKey is a system identifier and the server start time it was read
// with, as the server printed them.
type sysKey struct{ start, sysid string }

var (
	startText = regexp.MustCompile(`^[0-9]+(\.[0-9]+)?$`)
	sysidText = regexp.MustCompile(`^[0-9]+$`)
)

// keeps reports whether skip leaves a system identifier to keep: one read,
// and a start time to key it on.
func keeps(skip []string) bool {
	return !slices.Contains(skip, "pg_control_system") && !slices.Contains(skip, "pg_postmaster_start_time")
}

// historyCTE is the body of the claim's hist: the history and, where it
// read the system identifier from the control file, the identifier and the
// start time (sysid_read, start_read; NULL otherwise), for the Store to
// keep. With key, it takes the identifier from key while the server's
// start time is key's, and reads the control file otherwise.
func historyCTE(skip []string, key *sysKey) string {
	if !keeps(skip) {
		return `SELECT ` + historyOf(skip, sysidPart, startPart) + ` AS history, NULL::text AS sysid_read, NULL::text AS start_read`
	}
	if key == nil || !startText.MatchString(key.start) || !sysidText.MatchString(key.sysid) {
		return `SELECT ` + historyOf(skip, sysidPart, startPart) + ` AS history, ` + sysidPart + ` AS sysid_read, ` + startPart + ` AS start_read`
	}
	other := startPart + ` <> '` + key.start + `'`
	sysid := `CASE WHEN ` + other + ` THEN ` + sysidPart + ` ELSE '` + key.sysid + `' END`
	return `SELECT ` + historyOf(skip, sysid, startPart) + ` AS history,
	CASE WHEN ` + other + ` THEN ` + sysidPart + ` END AS sysid_read, CASE WHEN ` + other + ` THEN ` + startPart + ` END AS start_read`
}
