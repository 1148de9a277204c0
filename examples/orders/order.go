package main

import (
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/migrations"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/outbox"
)

// TypeOrderShipped is the one event type this service handles.
const TypeOrderShipped = "ORDER_SHIPPED"

// Shipped is an ORDER_SHIPPED event:
//
//	{"eventId":"shp_1","orderId":"ord_9","customerId":"cus_4","type":"ORDER_SHIPPED","carrier":"DHL","shippedAt":"2026-12-01T10:00:00Z"}
type Shipped struct {
	EventID    string    `json:"eventId"`
	OrderID    string    `json:"orderId"`
	CustomerID string    `json:"customerId"`
	Type       string    `json:"type"`
	Carrier    string    `json:"carrier"`
	ShippedAt  time.Time `json:"shippedAt"`
}

//go:embed migrations/*.sql
var files embed.FS

// Migrations is the service's own table, recorded in orders_migrations.
var Migrations = migrations.SetIn("orders_migrations", files, "migrations")

// Notifications is the outbox destination that tells customers their
// order shipped: the notifications API (main.go declares it).
const Notifications = "notifications"

// Notice is what the notifications API receives for a shipment.
type Notice struct {
	CustomerID string `json:"customerId"`
	OrderID    string `json:"orderId"`
	Carrier    string `json:"carrier"`
}

// Handler records shipments: one row per ORDER_SHIPPED event, whatever the
// broker redelivers.
type Handler struct {
	// Notify also sends a Notice per shipment To Notifications, through
	// the outbox: it leaves if and only if the shipment commits.
	Notify bool
}

var _ consumer.BatchHandler[Shipped] = Handler{}

// Decode reads the event; its time is shippedAt, so a replay older than
// the retention is refused.
func (Handler) Decode(m consumer.Message) (guard.Event, Shipped, error) {
	var s Shipped
	if err := json.Unmarshal(m.Body, &s); err != nil {
		return guard.Event{}, s, consumer.Reject("bad_json", err)
	}
	ev := guard.Event{ID: s.EventID, Time: s.ShippedAt, ShardKey: s.CustomerID}
	switch {
	case s.Type != TypeOrderShipped:
		return ev, s, consumer.Reject("unknown_type", fmt.Errorf("type %q", s.Type))
	case s.OrderID == "" || s.CustomerID == "" || s.Carrier == "":
		return ev, s, consumer.Reject("missing_field", errors.New("orderId, customerId and carrier are required"))
	}
	ev.Hash = guard.HashFields(s.EventID, s.OrderID, s.CustomerID, s.Carrier, s.ShippedAt.UTC().Format(time.RFC3339Nano))
	return ev, s, nil
}

// Reasons lists the dead-letter reasons Decode adds to idem's own, so that
// their metric series exist from the start.
func (Handler) Reasons() []string { return []string{"bad_json", "unknown_type", "missing_field"} }

// Apply records one shipment through tx, which also holds the event's
// dedup row.
func (h Handler) Apply(ctx context.Context, tx pgx.Tx, s Shipped) error {
	return h.ApplyBatch(ctx, tx, []Shipped{s})
}

// ApplyBatch records a batch of shipments in one statement, and with
// Notify enqueues their notices in the same transaction.
func (h Handler) ApplyBatch(ctx context.Context, tx pgx.Tx, ss []Shipped) error {
	ids, orders, customers, carriers := make([]string, len(ss)), make([]string, len(ss)), make([]string, len(ss)), make([]string, len(ss))
	at := make([]time.Time, len(ss))
	for i, s := range ss {
		ids[i], orders[i], customers[i], carriers[i], at[i] = s.EventID, s.OrderID, s.CustomerID, s.Carrier, s.ShippedAt
	}
	_, err := tx.Exec(ctx, `INSERT INTO shipments (event_id, order_id, customer_id, carrier, shipped_at)
		SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::timestamptz[])`, ids, orders, customers, carriers, at)
	if err != nil {
		return fmt.Errorf("record %d shipments: %w", len(ss), err)
	}
	if !h.Notify {
		return nil
	}
	notices := make([]outbox.Message, len(ss))
	for i, s := range ss {
		body, err := json.Marshal(Notice{CustomerID: s.CustomerID, OrderID: s.OrderID, Carrier: s.Carrier})
		if err != nil {
			return err
		}
		// Index 0: the event's one message, the same on every attempt.
		notices[i] = outbox.Message{EventID: s.EventID, To: Notifications, Key: s.CustomerID, Type: TypeOrderShipped, Body: body}
	}
	return outbox.Enqueue(ctx, tx, notices...)
}
