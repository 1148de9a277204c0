package sandbox

import (
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"
)

// ErrNoQueue means the queue does not exist.
var ErrNoQueue = errors.New("sandbox: no such queue")

// ReadyMessages returns the messages ready for delivery in queue (unacked
// ones are not counted: the broker's declare-ok does not say).
func ReadyMessages(amqpURL, queue string) (int, error) {
	conn, err := amqp.DialConfig(amqpURL, amqp.Config{Properties: amqp.Table{"connection_name": "idem-sandbox-inspect"}})
	if err != nil {
		return 0, fmt.Errorf("sandbox: inspect queue: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return 0, fmt.Errorf("sandbox: inspect queue: %w", err)
	}
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	var ae *amqp.Error
	if errors.As(err, &ae) && ae.Code == amqp.NotFound {
		return 0, fmt.Errorf("%w: %s", ErrNoQueue, queue)
	}
	if err != nil {
		return 0, fmt.Errorf("sandbox: inspect queue %s: %w", queue, err)
	}
	return q.Messages, nil
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
