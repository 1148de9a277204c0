package sandbox

import (
	"errors"
	"fmt"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/broker"
)

// ErrNoQueue means the queue does not exist.
var ErrNoQueue = errors.New("sandbox: no such queue")

// ReadyMessages returns the messages ready for delivery in queue (unacked
// ones are not counted: the broker's declare-ok does not say). For polling,
// use an Inspector, which keeps its connection.
func ReadyMessages(amqpURL, queue string) (int, error) {
	in := NewInspector(amqpURL)
	defer in.Close()
	return in.Ready(queue)
}

// Inspector reads queue depths over one connection and channel, opened on
// first use and reopened after an error, so that polling a queue does not
// cost the broker a connection per look. It is safe for concurrent use.
type Inspector struct {
	url  string
	mu   sync.Mutex
	conn *amqp.Connection
	ch   *amqp.Channel
}

// NewInspector returns an Inspector for the broker at amqpURL.
func NewInspector(amqpURL string) *Inspector { return &Inspector{url: amqpURL} }

// Ready returns the messages ready for delivery in queue, or an error
// wrapping ErrNoQueue if it does not exist.
func (in *Inspector) Ready(queue string) (int, error) {
	q, err := in.declare(queue)
	return q.Messages, err
}

// Consumers returns the consumers on queue, or an error wrapping ErrNoQueue
// if it does not exist.
func (in *Inspector) Consumers(queue string) (int, error) {
	q, err := in.declare(queue)
	return q.Consumers, err
}

// declare reads queue's declare-ok, with a passive declare.
func (in *Inspector) declare(queue string) (amqp.Queue, error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.ch == nil || in.ch.IsClosed() {
		if err := in.open(); err != nil {
			return amqp.Queue{}, fmt.Errorf("sandbox: inspect queue: %w", err)
		}
	}
	q, err := in.ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		in.ch = nil // a failed passive declare closes the channel
	}
	var ae *amqp.Error
	if errors.As(err, &ae) && ae.Code == amqp.NotFound {
		return amqp.Queue{}, fmt.Errorf("%w: %s", ErrNoQueue, queue)
	}
	if err != nil {
		return amqp.Queue{}, fmt.Errorf("sandbox: inspect queue %s: %w", queue, err)
	}
	return q, nil
}

func (in *Inspector) open() error {
	if in.conn == nil || in.conn.IsClosed() {
		conn, err := amqp.DialConfig(in.url, amqp.Config{Properties: amqp.Table{"connection_name": "idem-sandbox-inspect"}})
		if err != nil {
			return err
		}
		in.conn = conn
	}
	ch, err := in.conn.Channel()
	if err != nil {
		in.conn.Close()
		in.conn = nil
		return err
	}
	in.ch = ch
	return nil
}

// Close closes the connection.
func (in *Inspector) Close() {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.conn != nil {
		in.conn.Close()
		in.conn, in.ch = nil, nil
	}
}

// DeclareTopology declares t's queues and exchanges on a connection of its
// own, as its publishers and consumers do.
func DeclareTopology(amqpURL string, t broker.Topology) error {
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return fmt.Errorf("sandbox: declare %s: %w", t.Queue, err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err == nil {
		err = t.Declare(ch)
	}
	if err != nil {
		return fmt.Errorf("sandbox: declare %s: %w", t.Queue, err)
	}
	return nil
}

// DeleteQueue deletes queue with the dead-letter queue and exchange idem
// declares beside it (<queue>.dlq, <queue>.dlx).
func DeleteQueue(amqpURL, queue string) error {
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return fmt.Errorf("sandbox: delete queue %s: %w", queue, err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("sandbox: delete queue %s: %w", queue, err)
	}
	_, err1 := ch.QueueDelete(queue, false, false, false)
	_, err2 := ch.QueueDelete(queue+".dlq", false, false, false)
	err3 := ch.ExchangeDelete(queue+".dlx", false, false)
	return errors.Join(err1, err2, err3)
}
