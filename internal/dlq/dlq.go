// Package dlq reads and moves the messages of a consumer's dead-letter queue:
// it lists them by reason, shows them, replays them onto the work queue and
// purges them.
//
// Every operation walks a snapshot: the messages in the queue when it
// starts. The walk first publishes a fence (a marker message) to the queue's
// tail and reads up to it, so a message that arrives meanwhile (a replayed
// one that failed again included) lands behind the fence and is never acted
// on, and a replay never loops. A message is removed (acked) only once its
// operation is done (for a replay, once the broker confirmed the
// re-publish). A message kept is re-published to the tail, confirmed, and
// only then acked, never handed back: a quorum queue counts every hand-back
// as a failed delivery, and a broker with a delivery limit on the
// dead-letter queue (RabbitMQ 4 sets 20 by default) would drop a dead letter
// after that many walks. Every walk reads the whole snapshot, so the kept
// messages keep their order, whatever part of it an operation looked at.
//
// Publishes go out on a connection of their own: a broker that blocks
// publishers during a resource alarm must not stall the acks.
package dlq

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/wire"
)

// HeaderReplays counts how many times a message was replayed from the
// dead-letter queue. It survives dead-lettering, so a message that keeps
// coming back shows it.
const HeaderReplays = wire.HeaderReplays

// Message is one dead letter, with what the headers say about it.
//
// Who wrote it decides which headers are believed. A consumer writes a
// dead letter with x-idem-* headers of its own, having dropped every
// x-idem-* header (and x-death) of the delivery, so none of them is a
// producer's. The broker dead-letters a message (delivery limit, expiry,
// a rejection or a length limit) as its producer sent it, x-idem-*
// headers included, and adds x-death. So a dead letter with x-death is the
// broker's, whatever else it carries: its x-idem-* headers are the
// producer's, and ignored. (Anyone who may publish to the dead-letter
// queue itself can forge either kind: only consumers and the dlq tools
// should; see docs/security.md.)
type Message struct {
	D amqp.Delivery
	// ByBroker says that the broker dead-lettered the message (it carries
	// x-death), not a consumer: Reason, Queue and DeadLetteredAt are then
	// the broker's, and no x-idem-* header was read.
	ByBroker bool
	// Reason is the consumer's x-idem-reason, or the broker's x-death
	// reason ("delivery_limit" when the queue's x-delivery-limit was
	// reached; "expired", "rejected", "maxlen").
	Reason string
	// Error is the consumer's x-idem-error: what failed.
	Error string
	// Queue is the queue the message was dead-lettered from.
	Queue string
	// Attempts is how many deliveries the message had before it was
	// dead-lettered.
	Attempts int64
	// Replays is how many times it was replayed before (as the consumer
	// read it; 0 for the broker's dead letters).
	Replays int64
	// DeadLetteredAt is when it was dead-lettered; zero if unknown.
	DeadLetteredAt time.Time
	// EventID is the event ID the consumer read (wire.HeaderEventID),
	// else the AMQP message ID; empty if neither is known.
	EventID string
	// EventIDRead: EventID is the consumer's reading of the event, not
	// the message ID standing in for one (an undecodable message, a
	// broker's dead letter).
	EventIDRead bool
	// PayloadHash is the event's payload hash as the consumer computed it
	// (hex); empty if unknown.
	PayloadHash string
	// ShardKey is the event's shard key; empty if it has none.
	ShardKey string
	// BodyBytes is the length of the delivery's body when the dead letter
	// carries only its first bytes (wire.ReasonBodyTooLarge); 0 otherwise.
	BodyBytes int64
	// HeadersDropped names the producer's headers that were left out,
	// when a consumer, a replay or a walk cut the letter's headers to fit
	// the broker's frame_max (wire.HeaderHeadersDropped); empty otherwise.
	// It only informs: on a broker's letter, its producer may have set it.
	HeadersDropped string
}

// Truncated reports whether m carries only the first bytes of its body: a
// consumer cut it (wire.ReasonBodyTooLarge). Replaying it would publish a
// truncated event.
func (m Message) Truncated() bool {
	return !m.ByBroker && (m.Reason == wire.ReasonBodyTooLarge || m.BodyBytes > int64(len(m.D.Body)))
}

// byBroker reports whether the broker dead-lettered a message with headers
// h: it carries x-death, which a consumer's dead letters and a walk's
// fences never do.
func byBroker(h amqp.Table) bool {
	_, ok := h["x-death"]
	return ok
}

// Parse reads a dead letter's headers (see Message for which it believes).
func Parse(d amqp.Delivery) Message {
	m := Message{D: d, EventID: d.MessageId}
	h := d.Headers
	if m.ByBroker = byBroker(h); m.ByBroker {
		// The broker puts its latest dead-lettering first, with this
		// queue and reason, whatever x-death the producer sent.
		if deaths, ok := h["x-death"].([]any); ok && len(deaths) > 0 {
			if death, ok := deaths[0].(amqp.Table); ok {
				m.Reason, _ = death["reason"].(string)
				m.Queue, _ = death["queue"].(string)
				m.DeadLetteredAt, _ = death["time"].(time.Time)
			}
		}
		if m.Reason == "delivery_limit" {
			m.Reason = wire.ReasonDeliveryLimit
		}
		m.Attempts = toInt(h["x-delivery-count"])
	} else {
		m.Reason, _ = h[wire.HeaderReason].(string)
		m.Error, _ = h[wire.HeaderError].(string)
		m.Queue, _ = h[wire.HeaderQueue].(string)
		m.Attempts = toInt(h[wire.HeaderDeliveryCount])
		m.Replays = toInt(h[HeaderReplays])
		m.DeadLetteredAt, _ = h[wire.HeaderDeadLetteredAt].(time.Time)
		if id, _ := h[wire.HeaderEventID].(string); id != "" {
			m.EventID, m.EventIDRead = id, true
		}
		m.PayloadHash, _ = h[wire.HeaderPayloadHash].(string)
		m.ShardKey, _ = h[wire.HeaderShardKey].(string)
		m.BodyBytes = toInt(h[wire.HeaderBodyBytes])
	}
	if m.Reason == "" {
		m.Reason = "unknown"
	}
	m.HeadersDropped, _ = h[wire.HeaderHeadersDropped].(string)
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
	conn *amqp.Connection  // gets and acks
	pub  *broker.Publisher // fences, re-publishes and replays
	// Topology names the work queues (every partition) and their shared
	// dead-letter queue.
	Topology broker.Topology
	// Work is the queue the consumers read (with partitions, the name the
	// partition queues share); DLQ its dead-letter queue.
	Work, DLQ string
}

// Open connects to the broker at url (or to the first node of a
// comma-separated list that answers) for t's dead-letter queue: one
// connection to read and ack, one to the same node to publish. A refusal
// is dialled again until it lasts (broker.DialAtStart): a broker
// restarting under a tool is not taken for a bad password, and a lasting
// refusal is broker.ErrRefused.
func Open(ctx context.Context, url string, t broker.Topology) (*Queue, error) {
	urls := broker.SplitURLs(url)
	// The reading connection takes frames above the broker's frame_max:
	// a letter the broker dead-lettered can come in larger than any
	// message it accepts (broker.ReadFrameMax).
	conn, node, err := broker.DialAtStart(ctx, urls, 0, amqp.Config{FrameSize: broker.ReadFrameMax, Properties: amqp.Table{"connection_name": "idem-dlq"}})
	if err != nil {
		return nil, fmt.Errorf("dlq: dial: %w", err)
	}
	pubConn, _, err := broker.DialAtStart(ctx, urls[node:node+1], 0, amqp.Config{Properties: amqp.Table{"connection_name": "idem-dlq-publish"}})
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("dlq: dial publishing connection: %w", err)
	}
	pub, err := broker.NewPublisher(pubConn, broker.PublisherOptions{})
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("dlq: publishing connection: %w", err)
	}
	return &Queue{conn: conn, pub: pub, Topology: t, Work: t.Queue, DLQ: t.DeadLetterQueue}, nil
}

// Close closes the connections.
func (q *Queue) Close() error { return errors.Join(q.conn.Close(), q.pub.Close()) }

// HeaderFence marks the fence a walk publishes to the dead-letter queue's
// tail, with the walk's own ID.
const HeaderFence = "x-idem-dlq-fence"

// HeaderFenceOwner names, on a walk's fence, the queue the walk holds
// while it runs (see holdFence): another walk removes the fence as left
// behind only once that queue is gone.
const HeaderFenceOwner = "x-idem-dlq-fence-owner"

// staleFence is how old a fence without HeaderFenceOwner (an older idem's)
// must be to be taken for one a walk that died left behind, and removed.
const staleFence = time.Hour

// holdFence declares the queue that says the walk of fence runs: exclusive
// to the walk's connection, so the broker deletes it when the connection
// ends, however the walk ends; release deletes it when the walk returns. A
// walk may take longer than any age, so age alone cannot tell a fence left
// behind from one whose walk is still running.
func (q *Queue) holdFence(fence string) (owner string, release func(), err error) {
	ch, err := q.conn.Channel()
	if err != nil {
		return "", nil, fmt.Errorf("dlq: open channel: %w", err)
	}
	owner = walkQueuePrefix + fence
	if _, err := ch.QueueDeclare(owner, false, false, true, false, nil); err != nil {
		_ = ch.Close()
		return "", nil, fmt.Errorf("dlq: declare the walk's queue %q (the user needs configure permission on idem.dlq-walk.*): %w", owner, err)
	}
	return owner, func() {
		_, _ = ch.QueueDelete(owner, false, false, false)
		_ = ch.Close()
	}, nil
}

// fenceOf returns the walk ID of a fence. A fence is published by a walk
// straight to the dead-letter queue, so it never carries x-death, and its
// owner, if named, is a walk's queue: a producer's message that the broker
// dead-lettered with forged fence headers is a letter like any other, and
// can neither hide behind another walk's fence nor be removed as one left
// behind.
func fenceOf(d amqp.Delivery) (string, bool) {
	id, ok := d.Headers[HeaderFence].(string)
	if !ok {
		return "", false
	}
	if byBroker(d.Headers) {
		return "", false
	}
	if owner, named := d.Headers[HeaderFenceOwner]; named {
		if o, ok := owner.(string); !ok || o != walkQueuePrefix+id {
			return "", false
		}
	}
	return id, true
}

// walkQueuePrefix begins the name of the queue a running walk holds.
const walkQueuePrefix = "idem.dlq-walk."

// leftBehind reports whether fence d belongs to a walk that no longer
// runs: the queue it held is gone. Any other answer (the broker's
// resource_locked for another connection's exclusive queue, an error) is
// taken for a running walk, whose fence is kept.
func (q *Queue) leftBehind(d amqp.Delivery) bool {
	owner, ok := d.Headers[HeaderFenceOwner].(string)
	if !ok {
		return time.Since(d.Timestamp) > staleFence
	}
	ch, err := q.conn.Channel()
	if err != nil {
		return false
	}
	defer ch.Close() // already closed by the broker if the queue is gone or locked
	_, err = ch.QueueDeclarePassive(owner, false, false, true, false, nil)
	var ae *amqp.Error
	return errors.As(err, &ae) && ae.Code == amqp.NotFound
}

// Walk visits the messages in the dead-letter queue when it starts, oldest
// first (see the package comment), and acks those the visitor removes; it
// re-publishes the others to the tail, in order. After Stop it visits no
// more, but still moves the rest of the snapshot behind the ones it kept, so
// that the queue keeps its order; so it does after a visitor's error, which
// it returns once its fence is gone (the message that failed is kept). A
// kept letter that the broker grew past its frame_max is re-published cut
// to fit (keptOnCut). It returns how many it visited.
func (q *Queue) Walk(ctx context.Context, visit func(Message) (Verdict, error)) (int, error) {
	ch, err := q.conn.Channel()
	if err != nil {
		return 0, fmt.Errorf("dlq: open channel: %w", err)
	}
	defer ch.Close() // hands back a message whose re-publish failed
	_, err = ch.QueueDeclarePassive(q.DLQ, true, false, false, false, nil)
	var ae *amqp.Error
	switch {
	case errors.As(err, &ae) && ae.Code == amqp.NotFound:
		return 0, fmt.Errorf("dlq: queue %q does not exist: no consumer of queue %q has run on this broker and vhost (check queue / IDEM_QUEUE and amqp_url)", q.DLQ, q.Work)
	case err != nil:
		return 0, fmt.Errorf("dlq: queue %q: %w", q.DLQ, err)
	}
	p, err := q.publisher()
	if err != nil {
		return 0, err
	}
	fence := p.run
	owner, release, err := q.holdFence(fence)
	if err != nil {
		return 0, err
	}
	defer release()
	err = p.send(ctx, q.DLQ, amqp.Publishing{Headers: amqp.Table{HeaderFence: fence, HeaderFenceOwner: owner}, Timestamp: time.Now(), DeliveryMode: amqp.Persistent}, nil)
	if err != nil {
		return 0, fmt.Errorf("dlq: publish the walk's fence: %w", err)
	}
	keep := func(d amqp.Delivery) error {
		// The letter in hand is finished whatever happens to ctx: a
		// re-publish cancelled before its confirm would leave the copy in
		// the queue and hand the original back, a duplicate letter.
		kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), inFlightBound)
		defer cancel()
		if err := p.send(kctx, q.DLQ, copyOf(d), keptOnCut(d)); err != nil {
			return fmt.Errorf("dlq: keep %q: %w (it stays in %s)", d.MessageId, err, q.DLQ)
		}
		if err := d.Ack(false); err != nil {
			return fmt.Errorf("dlq: ack: %w", err)
		}
		return nil
	}
	visited, visiting := 0, true
	var failed error // the visitor's: the walk moves the rest on and returns it
	for {
		if err := ctx.Err(); err != nil {
			return visited, errors.Join(failed, err)
		}
		d, ok, err := ch.Get(q.DLQ, false)
		if err != nil {
			return visited, fmt.Errorf("dlq: get: %w", err)
		}
		if !ok {
			// The fence is gone, or another walk holds it: what is left
			// of the snapshot is held elsewhere.
			return visited, failed
		}
		if id, ok := fenceOf(d); ok {
			switch {
			case id == fence:
				return visited, errors.Join(failed, d.Ack(false)) // the snapshot is done
			case q.leftBehind(d):
				err = d.Ack(false) // left by a walk that died
			default:
				err = keep(d) // another walk's, running now
			}
			if err != nil {
				return visited, errors.Join(failed, err)
			}
			continue
		}
		v := Keep
		if visiting {
			visited++
			if v, err = visit(Parse(d)); err != nil {
				// Visit no more, but walk on to the fence, keeping the
				// rest: a walk that stopped here would leave its fence
				// behind, and the rest of the snapshot ahead of it.
				failed, v = err, Stop
			}
		}
		switch v {
		case Remove:
			err = d.Ack(false)
		case Stop:
			visiting = false
			err = keep(d)
		default:
			err = keep(d)
		}
		if err != nil {
			return visited, errors.Join(failed, err)
		}
	}
}

// inFlightBound bounds the re-publish of the letter a walk holds, which
// goes on when the walk's context ends (see Walk's keep).
const inFlightBound = 30 * time.Second

// keptOnCut says which of d's headers a walk keeps when it must cut them
// to re-publish d within the broker's frame_max (dead-lettering can grow a
// letter past it): the broker's record of the dead-lettering, if the
// broker wrote d, else idem's (see Message for whose headers are believed).
// The producer's are the ones that go.
func keptOnCut(d amqp.Delivery) func(string) bool {
	if !byBroker(d.Headers) {
		return wire.Ours
	}
	return func(k string) bool {
		return k == "x-death" || k == "x-delivery-count" ||
			strings.HasPrefix(k, "x-first-death-") || strings.HasPrefix(k, "x-last-death-")
	}
}

// copyOf is what re-publishing d to the same queue sends: d as it was.
func copyOf(d amqp.Delivery) amqp.Publishing {
	return amqp.Publishing{
		Headers:         d.Headers,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    amqp.Persistent,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		Expiration:      d.Expiration,
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		UserId:          d.UserId,
		AppId:           d.AppId,
		Body:            d.Body,
	}
}

// publisher publishes to queues through the default exchange on the
// Queue's confirming publisher, one message at a time, mandatory.
type publisher struct {
	p   *broker.Publisher
	run string // this publisher's ID: a walk's fence, the prefix of its replays' IDs
	seq int
}

// HeaderPublishID marks each publish so that a basic.return can be matched
// to it (broker.Publisher sets it).
const HeaderPublishID = broker.HeaderPublishID

func (q *Queue) publisher() (*publisher, error) {
	if err := q.pub.Err(); err != nil {
		return nil, fmt.Errorf("dlq: the publishing connection ended: %w", err)
	}
	var id [8]byte
	_, _ = rand.Read(id[:])
	return &publisher{p: q.pub, run: hex.EncodeToString(id[:])}, nil
}

// publishTimeout bounds the wait for one publish's confirm.
const publishTimeout = 10 * time.Second

// send publishes msg to queue and returns once the broker confirmed it;
// ErrNotRouted if no queue took it. If msg's header frame exceeds the
// broker's frame_max, the headers keep refuses are dropped until it fits
// (broker.Message.Keep); nil keeps them all, and such a msg is refused.
func (p *publisher) send(ctx context.Context, queue string, msg amqp.Publishing, keep func(string) bool) error {
	p.seq++
	ctx, cancel := context.WithTimeout(ctx, publishTimeout)
	defer cancel()
	res := p.p.Publish(ctx, broker.Message{Key: queue, Publishing: msg, Keep: keep})[0]
	switch res.Outcome {
	case broker.Confirmed:
		return nil
	case broker.Returned:
		return ErrNotRouted
	case broker.Unanswered:
		if errors.Is(res.Err, context.DeadlineExceeded) {
			return fmt.Errorf("publish: %w (is the broker blocking publishers? see its alarms)", res.Err)
		}
	}
	return fmt.Errorf("publish: %w", res.Err)
}

// HeaderReplayID marks each replay with the replaying run's ID, so that a
// replay that fails again and comes back is recognised.
const HeaderReplayID = wire.HeaderReplayID

// Replayer re-publishes dead letters onto the work queue.
type Replayer struct {
	p    *publisher
	topo broker.Topology
}

// Replayer replays onto the work queue through the Queue's confirming
// publisher. Close it when done.
func (q *Queue) Replayer() (*Replayer, error) {
	p, err := q.publisher()
	if err != nil {
		return nil, err
	}
	return &Replayer{p: p, topo: q.Topology}, nil
}

// Close ends the replays; the publisher stays the Queue's, closed with it.
func (r *Replayer) Close() error { return nil }

// headersDropped are the headers a replay does not carry: the dead letter's
// diagnosis and the broker's delivery counts, so that the replay starts with
// a fresh attempt budget.
var headersDropped = []string{
	wire.HeaderReason, wire.HeaderError, wire.HeaderQueue, wire.HeaderDeliveryCount,
	wire.HeaderDeadLetterID, wire.HeaderDeadLetteredAt, wire.HeaderEventID, wire.HeaderPayloadHash,
	wire.HeaderShardKey, HeaderReplayID, HeaderPublishID,
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
// be a loop. (A walk never reaches such a message, which lands behind its
// fence; this is a second guard.)
func (r *Replayer) Ours(m Message) bool {
	id, _ := m.D.Headers[HeaderReplayID].(string)
	return strings.HasPrefix(id, r.p.run+"-")
}

// Target is the work queue a replay of m goes to: the queue it was
// dead-lettered from, which with partitions is its key's partition (a
// replay comes after the key's later events: its place in their order is
// lost). A dead letter that names no queue
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
// A replay whose header frame would exceed the broker's frame_max leaves
// out the producer's largest headers and names them in
// wire.HeaderHeadersDropped; idem's are kept.
func (r *Replayer) Replay(ctx context.Context, m Message) error {
	p := Publishing(m)
	p.Headers[HeaderReplayID] = r.p.run + "-" + strconv.Itoa(r.p.seq+1)
	if err := r.p.send(ctx, r.Target(m), p, wire.Ours); err != nil {
		return fmt.Errorf("dlq: replay: %w", err)
	}
	return nil
}

// Replayed is what ReplayWhere did with one dead letter.
type Replayed int

const (
	// WasReplayed: the letter was replayed (or, dry, would be).
	WasReplayed Replayed = iota
	// WasCut: the letter matched but carries only the first bytes of its
	// body (Message.Truncated): it is never replayed, and stays.
	WasCut
)

// ReplayCounts counts what ReplayWhere did.
type ReplayCounts struct {
	Replayed int // replayed (dry: would be)
	Kept     int // left in the dead-letter queue: not matched, or cut
	Cut      int // matched, but cut: refused
}

// ReplayWhere replays, oldest first, the dead letters present when it
// starts that match picks, each leaving the dead-letter queue only once the
// broker confirmed its re-publish (Replay). A letter whose body was cut is
// refused and stays; a replay of this run that failed again and came back
// ends the walk. With dry it replays nothing and removes nothing. each, if
// set, hears of every letter replayed or refused. It is idem dlq replay's
// walk, and the console's.
func (q *Queue) ReplayWhere(ctx context.Context, match func(Message) bool, dry bool, each func(Message, Replayed)) (ReplayCounts, error) {
	var c ReplayCounts
	r, err := q.Replayer()
	if err != nil {
		return c, err
	}
	defer r.Close()
	_, err = q.Walk(ctx, func(m Message) (Verdict, error) {
		if r.Ours(m) {
			return Stop, nil // a replay of this run came back: the snapshot is done
		}
		if !match(m) {
			c.Kept++
			return Keep, nil
		}
		if m.Truncated() {
			c.Kept++
			c.Cut++
			if each != nil {
				each(m, WasCut)
			}
			return Keep, nil
		}
		if !dry {
			// As Walk's keep: the letter in hand is finished whatever
			// happens to ctx, so that a replay is not also kept.
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), inFlightBound)
			err := r.Replay(rctx, m)
			cancel()
			if err != nil {
				return Stop, fmt.Errorf("event %s: %w (it stays in %s)", m.EventID, err, q.DLQ)
			}
		}
		c.Replayed++
		if each != nil {
			each(m, WasReplayed)
		}
		if dry {
			return Keep, nil
		}
		return Remove, nil
	})
	return c, err
}
