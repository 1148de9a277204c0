// Package pgtier is the guard's authoritative tier on PostgreSQL.
//
// A claim inserts a row keyed by (scope, event_id) into idem_processed with
// INSERT … ON CONFLICT DO NOTHING, inside the transaction that the handler
// then uses for its effect. The row and the effect commit or roll back
// together; a concurrent claim of the same key waits on the first
// transaction's row and then sees a conflict (it committed) or inserts (it
// rolled back), so READ COMMITTED is enough and there is no check-then-act.
// The table comes from the migrations package (idem migrate). Do not
// partition it: the database's history, which a Redis done marker is
// checked against, reads the table's file node to see it truncated or
// restored, and a partitioned table has none. idem's service refuses one
// at start; a program that builds its guard from this package alone should
// not create one.
package pgtier
