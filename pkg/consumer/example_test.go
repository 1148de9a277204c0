package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
)

// refund is an event of a service's own.
type refund struct {
	ID     string `json:"id"`
	Order  string `json:"order"`
	Amount int64  `json:"amount"`
}

// refunds applies refunds one at a time (Apply) or a batch at once
// (ApplyBatch), through the transaction that holds the events' dedup rows.
type refunds struct{}

var _ consumer.BatchHandler[refund] = refunds{}

func (refunds) Decode(m consumer.Message) (guard.Event, refund, error) {
	var r refund
	if err := json.Unmarshal(m.Body, &r); err != nil {
		return guard.Event{}, r, consumer.Reject("bad_json", err)
	}
	if r.Amount <= 0 {
		return guard.Event{ID: r.ID}, r, consumer.Reject("bad_amount", fmt.Errorf("amount %d", r.Amount))
	}
	// The payload's own time, when it has one, is the event's time; here
	// the producer's AMQP timestamp is.
	return guard.Event{ID: r.ID, Hash: guard.HashFields(r.ID, r.Order, fmt.Sprint(r.Amount)), Time: m.Timestamp, ShardKey: r.Order}, r, nil
}

func (refunds) Apply(ctx context.Context, tx pgx.Tx, r refund) error {
	_, err := tx.Exec(ctx, `INSERT INTO refunds (id, order_id, amount) VALUES ($1, $2, $3)`, r.ID, r.Order, r.Amount)
	return err
}

func (refunds) ApplyBatch(ctx context.Context, tx pgx.Tx, rs []refund) error {
	ids, orders, amounts := make([]string, len(rs)), make([]string, len(rs)), make([]int64, len(rs))
	for i, r := range rs {
		ids[i], orders[i], amounts[i] = r.ID, r.Order, r.Amount
	}
	_, err := tx.Exec(ctx, `INSERT INTO refunds (id, order_id, amount)
		SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])`, ids, orders, amounts)
	return err
}

// A BatchHandler's Decode: what it returns is the guard's view of the
// event (ID, payload hash, time, shard key) and the handler's own value.
func ExampleBatchHandler() {
	at := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	ev, r, err := refunds{}.Decode(consumer.Message{Timestamp: at, Body: []byte(`{"id":"rf_1","order":"ord_9","amount":500}`)})
	fmt.Println(ev.ID, ev.ShardKey, ev.Time.Format(time.RFC3339), r.Amount, err)
	// Output: rf_1 ord_9 2026-12-01T10:00:00Z 500 <nil>
}

// Reject dead-letters an event at once, with a reason of the handler's
// own, instead of retrying it.
func ExampleReject() {
	_, _, err := refunds{}.Decode(consumer.Message{Body: []byte(`{"id":"rf_2","order":"ord_9","amount":-5}`)})
	var rej *consumer.RejectError
	if errors.As(err, &rej) {
		fmt.Println(rej.Reason, "-", rej.Err)
	}
	// Output: bad_amount - amount -5
}

// WithDefaults shows what a Config runs with: the values idem consume's
// settings default to as well.
func ExampleConfig_WithDefaults() {
	c := consumer.Config{Prefetch: 100}.WithDefaults()
	fmt.Println(c.Prefetch, c.BatchSize, c.Workers, c.HandlerTimeout, c.Retention, c.ClockSkew, c.Untimed)
	// Output: 100 100 2 10s 720h0m0s 5m0s auto
}
