-- The authoritative dedup table. One row per (scope, event_id), inserted in
-- the same transaction as the event's effect. The primary key is the guard:
-- it is global (no time partitioning), so retention never weakens uniqueness.
CREATE TABLE idem_processed (
    scope        text        NOT NULL,
    event_id     text        NOT NULL,
    payload_hash bytea       NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, event_id)
);

-- For idem prune, which deletes rows older than the retention window.
CREATE INDEX idem_processed_processed_at ON idem_processed (processed_at);
