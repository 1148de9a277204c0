-- The outbox: messages a handler sends to other systems, inserted in the
-- guard's transaction (so they exist if and only if the event's effect
-- committed) and published by idem relay. A row is identified by the event
-- that sent it: (scope, event_id, idx), from which the message ID is derived,
-- so a row published twice is the same message to its receiver.
--
-- state is pending until a relay's publish is confirmed (then sent, and the
-- row is deleted after outbox.retention) or until it fails max_attempts
-- times or for good (then dead, with last_error, until idem outbox replay).
-- lane spreads the rows over the relays: one relay at a time holds a lane
-- (a row of idem_outbox_lane, locked FOR UPDATE SKIP LOCKED), and the rows
-- of one key share a lane, so they leave in order. Relays read pending rows
-- by id with no cursor, so a transaction that commits late is never skipped.
CREATE TABLE idem_outbox (
    id          bigserial   PRIMARY KEY,
    scope       text        NOT NULL,
    event_id    text        NOT NULL,
    idx         integer     NOT NULL CHECK (idx >= 0),
    destination text        NOT NULL,
    key         text        NOT NULL DEFAULT '',
    lane        smallint    NOT NULL,
    type        text        NOT NULL DEFAULT '',
    content_type text       NOT NULL DEFAULT 'application/json',
    body        bytea       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    state       text        NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'sent', 'dead')),
    attempts    integer     NOT NULL DEFAULT 0,
    next_at     timestamptz NOT NULL DEFAULT '-infinity',
    last_error  text,
    sent_at     timestamptz,
    UNIQUE (scope, event_id, idx)
);
CREATE INDEX idem_outbox_pending ON idem_outbox (id) WHERE state = 'pending';
CREATE INDEX idem_outbox_sent ON idem_outbox (sent_at) WHERE state = 'sent';
CREATE INDEX idem_outbox_dead ON idem_outbox (id) WHERE state = 'dead';

CREATE TABLE idem_outbox_lane (
    lane smallint PRIMARY KEY
);
INSERT INTO idem_outbox_lane SELECT generate_series(0, 31);

-- A hint to idle relays, once per inserting statement (NOTIFY is delivered
-- at commit, and only once per transaction and payload). Relays poll as
-- well: a notification is lost while a relay is disconnected and does not
-- pass a transaction-mode pooler.
CREATE FUNCTION idem_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idem_outbox', '');
    RETURN NULL;
END $$;
CREATE TRIGGER idem_outbox_notify AFTER INSERT ON idem_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION idem_outbox_notify();
