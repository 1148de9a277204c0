// Package idem is the front door: it runs a handler on a RabbitMQ stream so
// that each event's effect commits exactly once, with everything the
// `idem consume` binary sets up around the guard and the consumer.
//
// A service gives New what it already has (a database URL or pgx pools, a
// Redis client or URL, the queue, its handler) and calls Run. Run applies
// the migrations if asked, checks each database's place among the shards
// and the stream's partition count, records the retention and clock skew
// the claim enforces, checks the Redis server and client, consumes until
// its context ends, drains, and writes the last done markers. Health serves
// the probes a platform needs; Config.Metrics registers idem's metrics;
// Config.Outbox declares where the handler's outbox messages go, and Run
// relays them in the same process.
//
// The defaults are the safe ones: a Config with only the required fields
// gets every guarantee the binary gives, and a setting that would open a
// hole is an error from New, not a silent one.
package idem
