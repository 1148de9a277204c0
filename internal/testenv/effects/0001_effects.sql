-- A handler's effect tables for the library's own tests. ledger has no
-- unique key on event_id on purpose: the guard alone stands between a
-- redelivery and a double, and a double shows.
CREATE TABLE ledger (
    id       bigserial PRIMARY KEY,
    event_id text      NOT NULL,
    user_id  text      NOT NULL,
    amount   bigint    NOT NULL
);
CREATE TABLE balances (
    user_id text   PRIMARY KEY,
    balance bigint NOT NULL DEFAULT 0
);
