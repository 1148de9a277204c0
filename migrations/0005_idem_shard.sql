-- Which shard of how many this database is, one row. The order of
-- postgres.shards routes every key to its shard (and with it, the key's dedup
-- history): a list reordered, lengthened or shortened would send keys to
-- databases that never saw them, and apply their redeliveries again. The
-- first consumer records the database's place; every later start compares
-- and refuses a mismatch. An unsharded database is shard 0 of 1.
CREATE TABLE idem_shard (
    id         boolean     PRIMARY KEY DEFAULT true CHECK (id),
    shard      integer     NOT NULL CHECK (shard >= 0),
    shards     integer     NOT NULL CHECK (shard < shards),
    recorded_at timestamptz NOT NULL DEFAULT now()
);
