package loadgen

import (
	"context"
	"fmt"
	"io"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/broker"
)

// PublishOptions says where and how fast to publish.
type PublishOptions struct {
	// URL is the broker's AMQP URL, or a cluster's, separated by commas.
	URL string
	// Topology names the queues; with partitions, each event goes to the
	// partition of its userId.
	Topology       broker.Topology
	ConnectionName string
	// Rate caps messages per second; 0 means as fast as confirms allow.
	Rate float64
	// Window is the most unconfirmed messages in flight. Defaults to 256.
	Window int
	// Progress, if set, receives a progress line every second.
	Progress io.Writer
	// StampSent adds HeaderSentAt to every message, for latency
	// measurements.
	StampSent bool
}

// HeaderSentAt carries, with StampSent, when the message was published, in
// Unix nanoseconds.
const HeaderSentAt = "x-idem-sent-at"

// Publish sends the stream's messages, persistent, to the queue through the
// default exchange, and returns once the broker confirmed every one. A
// nacked message is sent again, after the window in flight, up to five
// times; one never confirmed is an error: the manifest would lie.
func Publish(ctx context.Context, opt PublishOptions, s Stream) error {
	if opt.Window <= 0 {
		opt.Window = 256
	}
	p, err := openPublisher(ctx, opt, s)
	if err != nil {
		return err
	}
	defer p.conn.Close()
	start := time.Now()
	lastReport := start
	for n := range s.Order {
		if err := p.pace(ctx, start, n); err != nil {
			return err
		}
		dc, err := p.send(ctx, n)
		if err != nil {
			return err
		}
		p.inflight = append(p.inflight, pending{dc, n, 1})
		if len(p.inflight) >= opt.Window {
			if err := p.settle(ctx); err != nil {
				return err
			}
		}
		if err := p.returnedErr(); err != nil {
			return err
		}
		if opt.Progress != nil && time.Since(lastReport) >= time.Second {
			lastReport = time.Now()
			el := time.Since(start).Seconds()
			fmt.Fprintf(opt.Progress, "published %d/%d (%.0f msg/s)\n", n+1, len(s.Order), float64(n+1)/el)
		}
	}
	for len(p.inflight) > 0 {
		if err := p.settle(ctx); err != nil {
			return err
		}
	}
	// A return precedes its confirm, so every return has been counted by now.
	if err := p.returnedErr(); err != nil {
		return err
	}
	if opt.Progress != nil {
		el := time.Since(start).Seconds()
		fmt.Fprintf(opt.Progress, "published %d messages (%d distinct events) in %.1fs (%.0f msg/s), all confirmed\n",
			len(s.Order), len(s.Events), el, float64(len(s.Order))/el)
	}
	return nil
}

// maxSends bounds the sends of one message: a nack means the broker did not
// take it (a quorum queue whose leader is still being elected nacks, for
// one), so it is sent again, a few times, before Publish gives up.
const maxSends = 5

// pending is a message sent and not confirmed yet.
type pending struct {
	dc    *amqp.DeferredConfirmation
	n     int // position in Stream.Order
	sends int
}

// publisher is Publish's confirming channel and what it has in flight.
type publisher struct {
	opt      PublishOptions
	s        Stream
	conn     *amqp.Connection
	ch       *amqp.Channel
	returned *atomic.Int64 // messages the broker returned unroutable
	interval time.Duration // between sends at opt.Rate; 0: as fast as confirms allow
	inflight []pending
}

func openPublisher(ctx context.Context, opt PublishOptions, s Stream) (*publisher, error) {
	conn, _, err := broker.DialContext(ctx, broker.SplitURLs(opt.URL), 0, amqp.Config{Properties: amqp.Table{"connection_name": opt.ConnectionName}})
	if err != nil {
		return nil, fmt.Errorf("publish: dial: %w", err)
	}
	p := &publisher{opt: opt, s: s, conn: conn, returned: &atomic.Int64{}, inflight: make([]pending, 0, opt.Window)}
	if opt.Rate > 0 {
		p.interval = time.Duration(float64(time.Second) / opt.Rate)
	}
	if p.ch, err = conn.Channel(); err != nil {
		conn.Close()
		return nil, fmt.Errorf("publish: channel: %w", err)
	}
	if err := opt.Topology.Declare(p.ch); err != nil {
		conn.Close()
		return nil, fmt.Errorf("publish: %w", err)
	}
	if err := p.ch.Confirm(false); err != nil {
		conn.Close()
		return nil, fmt.Errorf("publish: confirm mode: %w", err)
	}
	// Drain returns in a goroutine: an undrained notify channel would stall
	// the connection. The library closes it when the channel closes.
	returns := p.ch.NotifyReturn(make(chan amqp.Return, 16))
	go func() {
		for range returns {
			p.returned.Add(1)
		}
	}()
	return p, nil
}

// pace waits until message n is due at opt.Rate.
func (p *publisher) pace(ctx context.Context, start time.Time, n int) error {
	if p.interval == 0 {
		return nil
	}
	d := time.Until(start.Add(time.Duration(n) * p.interval))
	if d <= 0 {
		return nil
	}
	select {
	case <-time.After(d):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// send publishes message n of the stream to its user's partition queue.
func (p *publisher) send(ctx context.Context, n int) (*amqp.DeferredConfirmation, error) {
	ev := p.s.Events[p.s.Order[n]]
	var headers amqp.Table
	if p.opt.StampSent {
		headers = amqp.Table{HeaderSentAt: time.Now().UnixNano()}
	}
	dc, err := p.ch.PublishWithDeferredConfirmWithContext(ctx, "", p.opt.Topology.QueueFor(ev.UserID), true, false, amqp.Publishing{
		Headers:      headers,
		ContentType:  "application/json",
		DeliveryMode: amqp.Persistent,
		MessageId:    ev.EventID,
		Timestamp:    time.Now(),
		Body:         ev.Marshal(),
	})
	if err != nil {
		return nil, fmt.Errorf("publish: message %d: %w", n, err)
	}
	return dc, nil
}

// settle waits for the oldest message's confirm, re-sending it on a nack.
func (p *publisher) settle(ctx context.Context) error {
	m := p.inflight[0]
	p.inflight = p.inflight[1:]
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ok, err := m.dc.WaitContext(cctx)
	if err != nil {
		return fmt.Errorf("publish: wait for confirm: %w", err)
	}
	if ok {
		return nil
	}
	if m.sends >= maxSends {
		return fmt.Errorf("publish: broker nacked message %d %d times", m.n, m.sends)
	}
	dc, err := p.send(ctx, m.n)
	if err != nil {
		return err
	}
	p.inflight = append(p.inflight, pending{dc, m.n, m.sends + 1})
	return nil
}

// returnedErr says whether the broker returned a message unroutable.
func (p *publisher) returnedErr() error {
	if n := p.returned.Load(); n > 0 {
		return fmt.Errorf("publish: %d message(s) returned unroutable: does queue %q exist?", n, p.opt.Topology.Queue)
	}
	return nil
}
