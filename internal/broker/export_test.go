package broker

import amqp "github.com/rabbitmq/amqp091-go"

// HeaderFrameSize exposes headerFrameSize to the tests.
var HeaderFrameSize = headerFrameSize

// SocketWrites is how many writes conn's socket has made (a connection
// Dial made).
func SocketWrites(conn *amqp.Connection) int64 { return corkable(conn).writes.Load() }

// Conn is the publisher's connection.
func (p *Publisher) Conn() *amqp.Connection { return p.conn }
