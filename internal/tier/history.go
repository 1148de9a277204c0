package tier

// History names one unbroken history of a store's rows: a database that
// has only moved forward since. The store reads it (pgtier: a hash of the
// cluster's system identifier, its timeline, the server's start, the
// database's OID and the dedup table's file); a failover, a restore, a
// re-created database or table, or a restart gives a new one. The fast
// tier writes it into every done marker and lease, and the guard trusts a
// done marker only if the store, asked after the marker was read, still
// reports the marker's history. The zero History is no history: that of a
// marker written by a version of idem that named none, or of a lease taken
// before the guard knew one; it matches nothing.
type History string

// Confirms reports whether a marker that names h may be trusted by a guard
// that has just read cur from the store: both are the same, known history.
func (h History) Confirms(cur History) bool { return h != "" && h == cur }
