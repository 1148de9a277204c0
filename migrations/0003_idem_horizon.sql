-- The replay horizon, one row, shared by the consumers and idem prune so
-- that they cannot disagree. Each consumer records at start the retention
-- and clock skew it enforces (the greatest ever recorded wins); prune refuses
-- a retention shorter than the recorded one, cuts at retention + clock skew,
-- and records how far it cut before deleting anything. A consumer reads
-- pruned_through at start and refuses events older than it.
-- (Version 2 was the reference handler's tables, which now have their own
-- migration set.)
CREATE TABLE idem_horizon (
    id             boolean     PRIMARY KEY DEFAULT true CHECK (id),
    retention      interval    NOT NULL,
    clock_skew     interval    NOT NULL,
    pruned_through timestamptz,
    updated_at     timestamptz NOT NULL DEFAULT now()
);
