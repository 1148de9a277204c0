package bench

import (
	"context"
	"fmt"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/pkg/guard"
)

// RunConfirmPublisher is the outbox rows' ceiling: it publishes n messages
// to queue with amqp091 alone, persistent, mandatory and with publisher
// confirms, shaped as the relay's (the same body and headers), inFlight at
// a time as one relay pass does: publish them all, wait for every confirm,
// then the next. It records each confirmed message in r, then waits for
// ctx to end; ctx ending first ends it too, without an error.
//
// It registers no NotifyReturn: a message returned as unroutable is still
// confirmed, and the bench notices it as one that never reached the
// destination's consumer.
func RunConfirmPublisher(ctx context.Context, url, queue string, n, inFlight int, r *Recorder) error {
	conn, err := amqp.DialConfig(url, amqp.Config{Properties: amqp.Table{"connection_name": "idem-bench-confirm-publisher"}})
	if err != nil {
		return fmt.Errorf("confirm publisher: dial: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("confirm publisher: channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		return fmt.Errorf("confirm publisher: confirm mode: %w", err)
	}
	// Every wait for the broker is bounded as a relay pass's is
	// (relay.Config.PublishTimeout's default).
	timeout := relay.Config{}.WithDefaults().PublishTimeout
	pending := make([]*amqp.DeferredConfirmation, 0, inFlight)
	for sent := 0; sent < n; {
		pctx, cancel := context.WithTimeout(ctx, timeout)
		pending = pending[:0]
		for ; sent < n && len(pending) < inFlight; sent++ {
			dc, err := ch.PublishWithDeferredConfirmWithContext(pctx, "", queue, true, false, confirmMessage(sent))
			if err != nil {
				cancel()
				if ctx.Err() != nil {
					return nil
				}
				return fmt.Errorf("confirm publisher: publish %d: %w", sent, err)
			}
			pending = append(pending, dc)
		}
		for _, dc := range pending {
			acked, err := dc.WaitContext(pctx)
			if err != nil {
				cancel()
				if ctx.Err() != nil {
					// The bench stops the publisher once the destination's
					// consumer has every message, which may be before the
					// last confirms arrive.
					return nil
				}
				return fmt.Errorf("confirm publisher: confirm %d: %w", dc.DeliveryTag, err)
			}
			if !acked {
				cancel()
				return fmt.Errorf("confirm publisher: message %d nacked", dc.DeliveryTag)
			}
			r.Settled(nil, guard.OutcomeProcessed)
		}
		cancel()
	}
	<-ctx.Done()
	return nil
}

// confirmMessage is the i-th message, as the relay would send the i-th
// row of the outbox rows' prefill.
func confirmMessage(i int) amqp.Publishing {
	id := "evt_" + strconv.Itoa(i+1)
	user := "user_" + strconv.Itoa((i+1)%1000)
	return amqp.Publishing{
		MessageId:    relay.MessageID("bench", id, 0),
		Type:         "RECEIPT_REQUESTED",
		ContentType:  "application/json",
		DeliveryMode: amqp.Persistent,
		Timestamp:    time.Now(),
		Headers: amqp.Table{"x-idem-scope": "bench", "x-idem-event-id": id, "x-idem-index": int32(0),
			broker.HeaderPublishID: "bench-" + strconv.Itoa(i+1)},
		Body: []byte(`{"type":"RECEIPT_REQUESTED","paymentId":"` + id + `","userId":"` + user + `","amount":1000}`),
	}
}
