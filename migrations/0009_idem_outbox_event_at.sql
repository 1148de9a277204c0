-- The time of the event whose transaction enqueued each outbox message (its
-- guard.Event.Time; NULL for an untimed event, and for rows enqueued before
-- this column): the relay sends it with the message as x-idem-source-time
-- (an AMQP header) or X-Idem-Source-Time (an HTTP header), RFC 3339 in UTC
-- to the microsecond, so that a receiver knows when what caused the message
-- happened however late the message is sent or replayed.
ALTER TABLE idem_outbox ADD COLUMN event_at timestamptz;
