// Package dlq reads and moves the messages of a consumer's dead-letter queue:
// it lists them by reason, shows them, replays them onto the work queue and
// purges them.
//
// Every operation works on a snapshot: the messages in the queue when it
// starts, taken with basic.get and held unacked. A message is removed (acked)
// only once its operation is done (for a replay, once the broker confirmed
// the re-publish); the others go back when the channel closes. A message that
// arrives meanwhile, a replayed one that failed again included, is not seen,
// so a replay never loops.
package dlq

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/pkg/consumer"
)

// HeaderReplays counts how many times a message was replayed from the
// dead-letter queue. It survives dead-lettering, so a message that keeps
// coming back shows it.
const HeaderReplays = "x-idem-replays"

// Message is one dead letter, with what the headers say about it.
type Message struct {
	D amqp.Delivery
	// Reason is the consumer's x-idem-reason, or the broker's x-death reason
	// ("delivery_limit" when the queue's x-delivery-limit was reached).
	Reason string
	// Error is the consumer's x-idem-error: what failed.
	Error string
	// Queue is the queue the message was dead-lettered from.
	Queue string
	// Attempts is how many deliveries the message had before it was
	// dead-lettered.
	Attempts int64
	// Replays is how many times it was replayed before.
	Replays int64
	// DeadLetteredAt is when it was dead-lettered; zero if unknown.
	DeadLetteredAt time.Time
}

// Parse reads a dead letter's headers.
func Parse(d amqp.Delivery) Message {
	m := Message{D: d}
	h := d.Headers
	m.Reason, _ = h[consumer.HeaderReason].(string)
	m.Error, _ = h[consumer.HeaderError].(string)
	m.Queue, _ = h[consumer.HeaderQueue].(string)
	m.Attempts = toInt(h[consumer.HeaderDeliveryCount])
	m.Replays = toInt(h[HeaderReplays])
	if t, ok := h[consumer.HeaderDeadLetteredAt].(time.Time); ok {
		m.DeadLetteredAt = t
	}
	// A message the broker dead-lettered (x-delivery-limit) has no idem
	// headers, only x-death.
	if deaths, ok := h["x-death"].([]any); ok && len(deaths) > 0 {
		if death, ok := deaths[0].(amqp.Table); ok {
			if m.Reason == "" {
				m.Reason, _ = death["reason"].(string)
				if m.Reason == "delivery_limit" {
					m.Reason = consumer.ReasonDeliveryLimit
				}
			}
			if m.Queue == "" {
				m.Queue, _ = death["queue"].(string)
			}
			if m.DeadLetteredAt.IsZero() {
				m.DeadLetteredAt, _ = death["time"].(time.Time)
			}
			if m.Attempts == 0 {
				m.Attempts = toInt(d.Headers["x-delivery-count"])
			}
		}
	}
	if m.Reason == "" {
		m.Reason = "unknown"
	}
	return m
}

func toInt(v any) int64 {
	switch n := v.(type) {
	case int64:
		return n
	case int32:
		return int64(n)
	case int:
		return int64(n)
	case int16:
		return int64(n)
	case int8:
		return int64(n)
	case string:
		i, _ := strconv.ParseInt(n, 10, 64)
		return i
	}
	return 0
}

// Verdict is what Walk's visitor decides for one message.
type Verdict int

const (
	// Keep leaves the message in the queue.
	Keep Verdict = iota
	// Remove acks it away.
	Remove
	// Stop leaves it and ends the walk.
	Stop
)

// Queue is a dead-letter queue and the work queues it belongs to.
type Queue struct {
	conn *amqp.Connection
	// Topology names the work queues (every partition) and their shared
	// dead-letter queue.
	Topology consumer.Topology
	// Work is the queue the consumers read (with partitions, the name the
	// partition queues share); DLQ its dead-letter queue.
	Work, DLQ string
}

// Open connects to the broker at url (or to the first node of a
// comma-separated list that answers) for t's dead-letter queue.
func Open(url string, t consumer.Topology) (*Queue, error) {
	conn, _, err := consumer.Dial(consumer.SplitURLs(url), 0, amqp.Config{Properties: amqp.Table{"connection_name": "idem-dlq"}})
	if err != nil {
		return nil, fmt.Errorf("dlq: dial: %w", err)
	}
	return &Queue{conn: conn, Topology: t, Work: t.Queue, DLQ: t.DeadLetterQueue}, nil
}

// Close closes the connection.
func (q *Queue) Close() error { return q.conn.Close() }

// Walk visits the messages in the dead-letter queue when it starts, oldest
// first, and acks those the visitor removes; the others go back to the queue
// when Walk returns. It returns how many it visited.
func (q *Queue) Walk(ctx context.Context, visit func(Message) (Verdict, error)) (int, error) {
	ch, err := q.conn.Channel()
	if err != nil {
		return 0, fmt.Errorf("dlq: open channel: %w", err)
	}
	defer ch.Close() // returns every message still unacked
	st, err := ch.QueueDeclarePassive(q.DLQ, true, false, false, false, nil)
	var ae *amqp.Error
	switch {
	case errors.As(err, &ae) && ae.Code == amqp.NotFound:
		return 0, fmt.Errorf("dlq: queue %q does not exist: no consumer of queue %q has run on this broker and vhost (check queue / IDEM_QUEUE and amqp_url)", q.DLQ, q.Work)
	case err != nil:
		return 0, fmt.Errorf("dlq: queue %q: %w", q.DLQ, err)
	}
	visited := 0
	for visited < st.Messages {
		if err := ctx.Err(); err != nil {
			return visited, err
		}
		d, ok, err := ch.Get(q.DLQ, false)
		if err != nil {
			return visited, fmt.Errorf("dlq: get: %w", err)
		}
		if !ok {
			break // someone else took the rest
		}
		visited++
		v, err := visit(Parse(d))
		if err != nil {
			return visited, err
		}
		switch v {
		case Remove:
			if err := d.Ack(false); err != nil {
				return visited, fmt.Errorf("dlq: ack: %w", err)
			}
		case Stop:
			return visited, nil
		}
	}
	return visited, nil
}

// Replayer re-publishes dead letters onto the work queue.
type Replayer struct {
	ch      *amqp.Channel
	returns chan amqp.Return
	topo    consumer.Topology
	run     string
	seq     int
}

// HeaderReplayID marks each re-publish so that a basic.return can be
// matched to it.
const HeaderReplayID = "x-idem-replay-id"

// Replayer opens a confirm-mode channel for replays onto the work queue.
// Close it when done.
func (q *Queue) Replayer() (*Replayer, error) {
	ch, err := q.conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("dlq: open channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		ch.Close()
		return nil, fmt.Errorf("dlq: confirm mode: %w", err)
	}
	return &Replayer{ch: ch, returns: ch.NotifyReturn(make(chan amqp.Return, 16)), topo: q.Topology,
		run: strconv.FormatInt(time.Now().UnixNano(), 36)}, nil
}

// Close closes the replay channel.
func (r *Replayer) Close() error { return r.ch.Close() }

// headersDropped are the headers a replay does not carry: the dead letter's
// diagnosis and the broker's delivery counts, so that the replay starts with
// a fresh attempt budget.
var headersDropped = []string{
	consumer.HeaderReason, consumer.HeaderError, consumer.HeaderQueue, consumer.HeaderDeliveryCount,
	consumer.HeaderDeadLetterID, consumer.HeaderDeadLetteredAt, HeaderReplayID,
	"x-death", "x-first-death-reason", "x-first-death-queue", "x-first-death-exchange",
	"x-last-death-reason", "x-last-death-queue", "x-last-death-exchange", "x-delivery-count",
}

// Publishing is what a replay of m publishes: its body, message ID, content
// type and original timestamp (the event's time, which the consumer's
// retention check reads), its producer's headers, and HeaderReplays + 1.
func Publishing(m Message) amqp.Publishing {
	d := m.D
	headers := amqp.Table{}
	for k, v := range d.Headers {
		headers[k] = v
	}
	for _, k := range headersDropped {
		delete(headers, k)
	}
	headers[HeaderReplays] = m.Replays + 1
	return amqp.Publishing{
		Headers:         headers,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    amqp.Persistent,
		MessageId:       d.MessageId,
		CorrelationId:   d.CorrelationId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		AppId:           d.AppId,
		Body:            d.Body,
	}
}

// ErrNotRouted means the broker had no queue for a replay: the work queue
// does not exist.
var ErrNotRouted = errors.New("the broker routed the replay to no queue (does the work queue exist?)")

// Ours reports whether m is a replay this Replayer published: it failed
// again and came back while the replay still runs. Replaying it again would
// be a loop.
func (r *Replayer) Ours(m Message) bool {
	id, _ := m.D.Headers[HeaderReplayID].(string)
	return strings.HasPrefix(id, r.run+"-")
}

// Target is the work queue a replay of m goes to: the queue it was
// dead-lettered from, which with partitions is its key's partition, so
// that the key's events keep their order. A dead letter that names no queue
// of the topology goes to the first.
func (r *Replayer) Target(m Message) string {
	queues := r.topo.Queues()
	if slices.Contains(queues, m.Queue) {
		return m.Queue
	}
	return queues[0]
}

// Replay publishes m onto its work queue (Target), mandatory, and returns
// once the broker confirmed it: only then may m leave the dead-letter queue.
func (r *Replayer) Replay(ctx context.Context, m Message) error {
	p := Publishing(m)
	r.seq++
	id := r.run + "-" + strconv.Itoa(r.seq)
	p.Headers[HeaderReplayID] = id
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	dc, err := r.ch.PublishWithDeferredConfirmWithContext(ctx, "", r.Target(m), true, false, p)
	if err != nil {
		return fmt.Errorf("dlq: replay publish: %w", err)
	}
	ok, err := dc.WaitContext(ctx)
	switch {
	case err != nil:
		return fmt.Errorf("dlq: replay confirm: %w", err)
	case !ok:
		return errors.New("dlq: the broker nacked the replay")
	}
	// The broker sends basic.return before the ack.
	for {
		select {
		case ret := <-r.returns:
			if ret.Headers[HeaderReplayID] == id {
				return ErrNotRouted
			}
		default:
			return nil
		}
	}
}
