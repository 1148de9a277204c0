-- IF NOT EXISTS: databases migrated before the reference handler's tables
-- got their own migration set already have them.
-- The reference handler's tables. payments_ledger has no unique constraint on
-- event_id on purpose: the handler is not idempotent by itself, so the guard
-- alone stands between a redelivery and a double payment, and a double shows.
CREATE TABLE IF NOT EXISTS payments_ledger (
    id         bigserial   PRIMARY KEY,
    event_id   text        NOT NULL,
    user_id    text        NOT NULL,
    amount     bigint      NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS payments_ledger_event_id ON payments_ledger (event_id);

CREATE TABLE IF NOT EXISTS account_balances (
    user_id    text        PRIMARY KEY,
    balance    bigint      NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now()
);
