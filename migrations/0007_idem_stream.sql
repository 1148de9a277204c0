-- How many partition queues each stream is split over, one row per stream
-- (its queue name). Consumers and idem publish compare their partitions
-- setting with it at start and refuse a mismatch: a publisher routing by 4
-- partitions and consumers reading 2 would strand every event routed to the
-- other two. idem repartition changes it, once the old queues are empty, and
-- keeps the count before as previous, whose queues consumers then watch for
-- messages a stale publisher strands there.
CREATE TABLE idem_stream (
    queue      text        PRIMARY KEY,
    partitions integer     NOT NULL CHECK (partitions >= 1),
    previous   integer     CHECK (previous >= 1),
    changed_at timestamptz NOT NULL DEFAULT now()
);
