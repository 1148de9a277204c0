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
	conn, _, err := broker.Dial(broker.SplitURLs(opt.URL), 0, amqp.Config{Properties: amqp.Table{"connection_name": opt.ConnectionName}})
	if err != nil {
		return fmt.Errorf("publish: dial: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("publish: channel: %w", err)
	}
	if err := opt.Topology.Declare(ch); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		return fmt.Errorf("publish: confirm mode: %w", err)
	}
	// Drain returns in a goroutine: an undrained notify channel would stall
	// the connection. The library closes it when the channel closes.
	var returned atomic.Int64
	returns := ch.NotifyReturn(make(chan amqp.Return, 16))
	go func() {
		for range returns {
			returned.Add(1)
		}
	}()

	var interval time.Duration
	if opt.Rate > 0 {
		interval = time.Duration(float64(time.Second) / opt.Rate)
	}
	start := time.Now()
	lastReport := start
	// A nack means the broker did not take the message (a quorum queue
	// whose leader is still being elected nacks, for one): send it again,
	// a few times, before giving up.
	const maxSends = 5
	type pending struct {
		dc    *amqp.DeferredConfirmation
		n     int // position in s.Order
		sends int
	}
	publish := func(n int) (*amqp.DeferredConfirmation, error) {
		ev := s.Events[s.Order[n]]
		var headers amqp.Table
		if opt.StampSent {
			headers = amqp.Table{HeaderSentAt: time.Now().UnixNano()}
		}
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", opt.Topology.QueueFor(ev.UserID), true, false, amqp.Publishing{
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
	inflight := make([]pending, 0, opt.Window)
	// settle waits for the oldest message's confirm, re-sending it on a nack.
	settle := func() error {
		p := inflight[0]
		inflight = inflight[1:]
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		ok, err := p.dc.WaitContext(cctx)
		if err != nil {
			return fmt.Errorf("publish: wait for confirm: %w", err)
		}
		if ok {
			return nil
		}
		if p.sends >= maxSends {
			return fmt.Errorf("publish: broker nacked message %d %d times", p.n, p.sends)
		}
		dc, err := publish(p.n)
		if err != nil {
			return err
		}
		inflight = append(inflight, pending{dc, p.n, p.sends + 1})
		return nil
	}
	for n := range s.Order {
		if interval > 0 {
			if d := time.Until(start.Add(time.Duration(n) * interval)); d > 0 {
				select {
				case <-time.After(d):
				case <-ctx.Done():
					return ctx.Err()
				}
			}
		}
		dc, err := publish(n)
		if err != nil {
			return err
		}
		inflight = append(inflight, pending{dc, n, 1})
		if len(inflight) >= opt.Window {
			if err := settle(); err != nil {
				return err
			}
		}
		if n := returned.Load(); n > 0 {
			return fmt.Errorf("publish: %d message(s) returned unroutable: does queue %q exist?", n, opt.Topology.Queue)
		}
		if opt.Progress != nil && time.Since(lastReport) >= time.Second {
			lastReport = time.Now()
			el := time.Since(start).Seconds()
			fmt.Fprintf(opt.Progress, "published %d/%d (%.0f msg/s)\n", n+1, len(s.Order), float64(n+1)/el)
		}
	}
	for len(inflight) > 0 {
		if err := settle(); err != nil {
			return err
		}
	}
	// A return precedes its confirm, so every return has been counted by now.
	if n := returned.Load(); n > 0 {
		return fmt.Errorf("publish: %d message(s) returned unroutable: does queue %q exist?", n, opt.Topology.Queue)
	}
	if opt.Progress != nil {
		el := time.Since(start).Seconds()
		fmt.Fprintf(opt.Progress, "published %d messages (%d distinct events) in %.1fs (%.0f msg/s), all confirmed\n",
			len(s.Order), len(s.Events), el, float64(len(s.Order))/el)
	}
	return nil
}
