package relay

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/broker"
)

// amqpPublisher holds the relay's confirming publisher (broker.Publisher),
// dialled on first use and again after it ends.
//
// Only the broker's answer about a message spends a row's attempt: a nack,
// a return, or a message that cannot be encoded. A lost connection or a
// confirm that never came spends nothing, however often it happens. A
// channel exception (404 no such exchange, say) answers one of the publishes
// in flight without saying which, so the rows it left unanswered become
// suspects: the next pass publishes each of them alone, and one refused
// alone spends its attempt. A poison row goes dead; its neighbours do not.
type amqpPublisher struct {
	urls    []string
	name    string
	metrics *Metrics

	mu      sync.Mutex
	pub     *broker.Publisher
	next    int            // the node to dial first
	suspect map[int64]bool // rows a channel exception left unanswered
	closing sync.WaitGroup // publishers being closed aside (close)
	// refused is the last dial's refusal (broker.IsRefused); nil once a
	// dial ends otherwise. The relay is not ready while it is fresh.
	refused atomic.Pointer[refusal]
}

// refusal is why the broker refused a dial, and when.
type refusal struct {
	why string
	at  time.Time
}

// refusalShown is how long a refusal keeps the relay not ready: past the
// longest backoff between passes, so that the passes without rows for the
// broker, which dial nothing, do not make it ready meanwhile; and not for
// ever, for a relay whose rows another relay sent.
const refusalShown = 3 * maxPassBackoff

// lastRefusal returns why the broker refused the last dial, if it did
// lately.
func (p *amqpPublisher) lastRefusal() error {
	if r := p.refused.Load(); r != nil && time.Since(r.at) < refusalShown {
		return errors.New(r.why)
	}
	return nil
}

// connName is the relay's connection name: its Name, or
// idem-relay-<host>-<pid>. Its pauses are recorded under it.
func (p *amqpPublisher) connName() string {
	if p.name != "" {
		return p.name
	}
	host, _ := os.Hostname()
	return fmt.Sprintf("idem-relay-%s-%d", host, os.Getpid())
}

// publisher returns a running publisher, dialling within ctx if need be.
func (p *amqpPublisher) publisher(ctx context.Context) (*broker.Publisher, error) {
	if p.pub != nil && p.pub.Err() == nil {
		return p.pub, nil
	}
	p.close()
	conn, i, err := broker.DialContext(ctx, p.urls, p.next, amqp.Config{Properties: amqp.Table{"connection_name": p.connName()}})
	if err != nil {
		p.next++
		if !broker.IsRefused(err) {
			p.refused.Store(nil)
			return nil, fmt.Errorf("amqp: %w", err)
		}
		// Maybe a bad password, maybe a broker restarting: the pass fails,
		// spending no row's attempt, and the next one dials again.
		p.metrics.refused()
		err = fmt.Errorf("amqp: %w", broker.Explain(err))
		p.refused.Store(&refusal{why: err.Error(), at: time.Now()})
		return nil, err
	}
	p.refused.Store(nil)
	p.next = i
	if p.pub, err = broker.NewPublisherContext(ctx, conn, broker.PublisherOptions{}); err != nil {
		return nil, fmt.Errorf("amqp: %w", err)
	}
	return p.pub, nil
}

// publishAll publishes rows[idx], mandatory and persistent, waits for their
// confirms, and fills in results. The error says the broker could not be
// reached, blocked publishing, or did not answer in time: the rows it left
// without an answer are skipped, their attempts untouched.
func (p *amqpPublisher) publishAll(ctx context.Context, dests map[string]Destination, rows []*row, idx []int, results []result) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.suspect) > maxSuspects || p.suspect == nil {
		p.suspect = map[int64]bool{} // rows other relays settled meanwhile
	}
	skip(results, idx)
	var alone, together []int
	for _, i := range idx {
		if p.suspect[rows[i].id] {
			alone = append(alone, i)
		} else {
			together = append(together, i)
		}
	}
	var errs []error
	for _, i := range alone {
		if ctx.Err() != nil {
			break // the pass is over: the rest wait for the next
		}
		errs = append(errs, p.send(ctx, dests, rows, []int{i}, results))
	}
	if len(together) > 0 && ctx.Err() == nil {
		errs = append(errs, p.send(ctx, dests, rows, together, results))
	}
	return errors.Join(errs...)
}

// send publishes rows[idx] in one go on the running publisher.
func (p *amqpPublisher) send(ctx context.Context, dests map[string]Destination, rows []*row, idx []int, results []result) error {
	pub, err := p.publisher(ctx)
	if err != nil {
		return err
	}
	if why, _ := pub.Blocked(); why != "" {
		return fmt.Errorf("amqp: the broker blocks publishing (%s)", why)
	}
	msgs := make([]broker.Message, len(idx))
	for k, i := range idx {
		w := rows[i]
		exchange, key := dests[w.destination].route(w.key)
		msgs[k] = broker.Message{Exchange: exchange, Key: key, Publishing: amqp.Publishing{
			MessageId:    w.messageID(),
			Type:         w.typ,
			ContentType:  w.ctype,
			DeliveryMode: amqp.Persistent,
			Timestamp:    w.created,
			Headers:      amqp.Table{"x-idem-scope": w.scope, "x-idem-event-id": w.eventID, "x-idem-index": int32(w.idx)},
			Body:         w.body,
		}}
		if t := w.sourceTime(); t != "" {
			msgs[k].Headers[HeaderSourceTime] = t
		}
	}
	var lost error
	for k, res := range pub.Publish(ctx, msgs...) {
		i := idx[k]
		id := rows[i].id
		switch res.Outcome {
		case broker.Confirmed:
			results[i] = result{sent: true}
			delete(p.suspect, id)
		case broker.Returned:
			results[i] = result{err: fmt.Errorf("amqp: %w", res.Err), class: "amqp: returned unroutable"}
			delete(p.suspect, id)
		case broker.Nacked:
			results[i] = result{err: fmt.Errorf("amqp: %w", res.Err), class: "amqp: nacked"}
			delete(p.suspect, id)
		case broker.Invalid:
			results[i] = result{err: fmt.Errorf("amqp: %w", res.Err)}
			delete(p.suspect, id)
		case broker.Refused:
			if len(idx) == 1 {
				results[i] = result{err: fmt.Errorf("amqp: %w", res.Err), class: refusedClass(res.Err)}
				delete(p.suspect, id)
			} else {
				p.suspect[id] = true
			}
			lost = cmp.Or(lost, fmt.Errorf("amqp: %w", res.Err))
		default:
			lost = cmp.Or(lost, fmt.Errorf("amqp: %w", res.Err))
		}
	}
	if lost != nil {
		// A channel that missed confirms cannot be trusted with the
		// next pass's: its late answers would be taken for theirs.
		p.close()
	}
	return lost
}

// refusedClass is the pause class of a publish the broker refused by
// closing the channel: its reply code (404 no such exchange, 403 access
// refused, ...).
func refusedClass(err error) string {
	var ae *amqp.Error
	if errors.As(err, &ae) {
		return fmt.Sprintf("amqp: channel closed %d", ae.Code)
	}
	return "amqp: channel closed"
}

// close drops the publisher and closes it aside: a silent broker holds a
// close up to broker.CloseTimeout, which a pass, holding its transaction,
// does not wait out. closeAll waits for it.
func (p *amqpPublisher) close() {
	if old := p.pub; old != nil {
		p.pub = nil
		p.closing.Go(func() { _ = old.Close() })
	}
}

// closeAll closes the publisher at the end of Run, and waits for every
// close.
func (p *amqpPublisher) closeAll() {
	p.mu.Lock()
	p.close()
	p.mu.Unlock()
	p.closing.Wait()
}

// maxSuspects bounds the suspects a relay remembers.
const maxSuspects = 4096

func skip(results []result, idx []int) {
	for _, i := range idx {
		results[i] = result{skipped: true}
	}
}
