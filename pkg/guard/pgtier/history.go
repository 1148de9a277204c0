package pgtier

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
