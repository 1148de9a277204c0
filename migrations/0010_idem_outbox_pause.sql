-- The outbox destinations a relay has paused: PauseRows distinct rows in a
-- row failed alike (an HTTP 401, 403 or 5xx, no answer, a message returned
-- unroutable, ...), so the relay stopped sending that destination's rows,
-- which stay pending and spend no attempt, and probes with one row on a
-- backoff. One row per relay (its connection name) and destination,
-- written when it pauses and on each failed probe; every row of a
-- destination goes once a relay's probe is answered. idem outbox list shows
-- them; a row whose relay died stays, with the time it was last written.
CREATE TABLE idem_outbox_pause (
    destination text        NOT NULL,
    relay       text        NOT NULL,
    class       text        NOT NULL,
    last_error  text        NOT NULL,
    since       timestamptz NOT NULL,
    next_probe  timestamptz NOT NULL,
    probes      integer     NOT NULL,
    updated_at  timestamptz NOT NULL,
    PRIMARY KEY (destination, relay)
);
