// Package consumer runs a guarded handler on a RabbitMQ queue: topology,
// prefetch, a batched pipeline (gather, screen with the fast tier, decide in
// one Postgres transaction per batch), manual acks after the outcome is
// durable, retries with backoff, dead-lettering with a reason and a
// publisher confirm, reconnection, and a clean drain on shutdown.
//
// A delivery is acked only once its outcome is durable: committed, known to be
// a duplicate, or dead-lettered and confirmed by the broker. Anything else
// leaves it unacked or nacks it back to the queue, so a crash at any point
// leads to a redelivery, which the guard turns into "processed once".
package consumer
