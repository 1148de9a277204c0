-- The orders service's own table. No unique key on event_id, on purpose:
-- the guard alone stands between a redelivery and a second shipment row,
-- so a double would show.
CREATE TABLE shipments (
    id          bigserial   PRIMARY KEY,
    event_id    text        NOT NULL,
    order_id    text        NOT NULL,
    customer_id text        NOT NULL,
    carrier     text        NOT NULL,
    shipped_at  timestamptz NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX shipments_order_id ON shipments (order_id);
