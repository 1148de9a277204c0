-- When a consumer last claimed an event that carries no time. Such an event's
-- age cannot be checked, so it is claimed only while nothing was ever pruned
-- (pruned_through IS NULL); idem prune refuses to make the first cut while
-- untimed events are still arriving, because from that cut on they are
-- refused. Written at most once a minute by each process that claims one.
ALTER TABLE idem_horizon ADD COLUMN untimed_claimed_at timestamptz;
