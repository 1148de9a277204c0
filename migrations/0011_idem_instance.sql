-- The running consumers and relays, as each reports itself every few
-- seconds (package heartbeat): what idem console shows as the fleet. One row
-- per process; it goes when the process stops cleanly. A row whose
-- seen_at is old is a process that died or lost its database: the
-- console says how long it has been silent. Counts are since the process
-- started; rates are over its last report's interval.
CREATE TABLE idem_instance (
    instance   text        PRIMARY KEY,
    kind       text        NOT NULL,
    scope      text        NOT NULL,
    queue      text        NOT NULL,
    version    text        NOT NULL,
    started_at timestamptz NOT NULL,
    seen_at    timestamptz NOT NULL,
    every_ms   integer     NOT NULL,
    ready      boolean     NOT NULL,
    why        text        NOT NULL,
    tripped_on text        NOT NULL,
    breaker    text        NOT NULL,
    counts     jsonb       NOT NULL,
    rates      jsonb       NOT NULL
);
