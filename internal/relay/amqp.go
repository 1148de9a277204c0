package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/broker"
)

// amqpPublisher holds the relay's connection and confirm-mode channel,
// opened on first use and again after either closes.
type amqpPublisher struct {
	urls []string
	name string
	log  *slog.Logger

	mu      sync.Mutex
	conn    *amqp.Connection
	ch      *amqp.Channel
	returns chan amqp.Return
	blocked chan amqp.Blocking
	next    int    // the node to dial first
	block   string // why the broker blocks the connection ("" if it does not)
}

// channel returns an open confirm-mode channel, dialling if need be.
func (p *amqpPublisher) channel() (*amqp.Channel, error) {
	if p.ch != nil && !p.ch.IsClosed() && !p.conn.IsClosed() {
		return p.ch, nil
	}
	p.close()
	name := p.name
	if name == "" {
		name = fmt.Sprintf("idem-relay-%d", os.Getpid())
	}
	conn, i, err := broker.Dial(p.urls, p.next, amqp.Config{Properties: amqp.Table{"connection_name": name}})
	if err != nil {
		p.next++
		return nil, fmt.Errorf("amqp: %w", err)
	}
	p.next = i
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Confirm(false)
	}
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("amqp: open channel: %w", err)
	}
	p.conn, p.ch = conn, ch
	// Returns arrive before the confirm of the message they return, on the
	// connection's one reader; the buffer must hold a pass's worth, so
	// that the reader never waits on it while we wait on confirms.
	p.returns = ch.NotifyReturn(make(chan amqp.Return, 4096))
	p.blocked = conn.NotifyBlocked(make(chan amqp.Blocking, 4))
	return ch, nil
}

// publishAll publishes rows[idx], mandatory and persistent, waits for their
// confirms, and fills in results. The error says the broker could not be
// reached or did not confirm in time: the rows it left without an answer
// are skipped.
func (p *amqpPublisher) publishAll(ctx context.Context, dests map[string]Destination, rows []*row, idx []int, results []result) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	ch, err := p.channel()
	if err != nil {
		skip(results, idx)
		return err
	}
	confirms := make([]*amqp.DeferredConfirmation, len(idx))
	var pubErr error
	for k, i := range idx {
		w := rows[i]
		exchange, key := dests[w.destination].route(w.key)
		confirms[k], pubErr = ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, amqp.Publishing{
			MessageId:    w.messageID(),
			Type:         w.typ,
			ContentType:  w.ctype,
			DeliveryMode: amqp.Persistent,
			Timestamp:    w.created,
			Headers:      amqp.Table{"x-idem-scope": w.scope, "x-idem-event-id": w.eventID, "x-idem-index": int32(w.idx)},
			Body:         w.body,
		})
		if pubErr != nil {
			break
		}
	}
	var waitErr error
	for k, i := range idx {
		if confirms[k] == nil {
			results[i] = result{skipped: true}
			continue
		}
		acked, err := confirms[k].WaitContext(ctx)
		switch {
		case err != nil:
			results[i] = result{skipped: true}
			waitErr = err
		case !acked:
			results[i] = result{err: errors.New("amqp: the broker refused the message (nack): a full queue, say")}
		default:
			results[i] = result{sent: true}
		}
	}
	p.markReturned(rows, idx, results)
	if pubErr != nil || waitErr != nil {
		reason := p.blockReason()
		p.close() // a channel that missed confirms cannot be trusted with the next pass's
		if reason != "" {
			return fmt.Errorf("amqp: the broker blocks publishing (%s): %w", reason, errors.Join(pubErr, waitErr))
		}
		return fmt.Errorf("amqp: publish: %w", errors.Join(pubErr, waitErr))
	}
	return nil
}

// markReturned turns the confirmed rows the broker returned (no queue took
// them) into failures.
func (p *amqpPublisher) markReturned(rows []*row, idx []int, results []result) {
	if len(p.returns) == 0 {
		return
	}
	byID := make(map[string]int, len(idx))
	for _, i := range idx {
		byID[rows[i].messageID()] = i
	}
	for {
		select {
		case ret := <-p.returns:
			if i, ok := byID[ret.MessageId]; ok {
				results[i] = result{err: fmt.Errorf("amqp: returned %d %s: no queue is bound to exchange %q with routing key %q",
					ret.ReplyCode, ret.ReplyText, ret.Exchange, ret.RoutingKey)}
			}
		default:
			return
		}
	}
}

// blockReason drains connection.blocked notifications and returns the
// last active one's reason ("" if unblocked).
func (p *amqpPublisher) blockReason() string {
	for {
		select {
		case b := <-p.blocked:
			p.block = ""
			if b.Active {
				p.block = b.Reason
			}
		default:
			return p.block
		}
	}
}

func (p *amqpPublisher) close() {
	if p.conn != nil {
		_ = p.conn.Close()
	}
	p.conn, p.ch, p.block = nil, nil, ""
}

func skip(results []result, idx []int) {
	for _, i := range idx {
		results[i] = result{skipped: true}
	}
}
