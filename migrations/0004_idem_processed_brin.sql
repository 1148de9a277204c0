-- idem prune finds expired rows by processed_at. Rows are appended in
-- roughly processed_at order, so a BRIN index (a few pages for millions of
-- rows) serves that scan, and unlike a B-tree it costs next to nothing per
-- insert: one B-tree insert per event was a good share of the guard's work
-- in Postgres.
DROP INDEX IF EXISTS idem_processed_processed_at;
CREATE INDEX idem_processed_processed_at ON idem_processed USING brin (processed_at);
