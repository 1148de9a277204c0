// Package broker holds what the consumer and idem's tools share about
// RabbitMQ: the topology a stream declares (its queues, partitions and
// dead-letter queue), dialling a list of nodes, and the name of a
// consumer's publishing connection.
package broker
