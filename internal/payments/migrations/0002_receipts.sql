-- The second hop of the reference pipeline: each payment sends a
-- RECEIPT_REQUESTED through the outbox, and the receipts handler records one
-- receipt per request. Like payments_ledger, receipts has no unique key on
-- event_id or payment_id on purpose: a message published twice by a relay
-- that died before marking it sent would show as a second receipt, were it
-- not for the receiving consumer's own guard.
CREATE TABLE receipts (
    id         bigserial   PRIMARY KEY,
    event_id   text        NOT NULL,
    payment_id text        NOT NULL,
    user_id    text        NOT NULL,
    amount     bigint      NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX receipts_payment_id ON receipts (payment_id);
