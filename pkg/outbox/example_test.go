package outbox_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemhq/idem/pkg/outbox"
)

// shipment is an event of a service's own.
type shipment struct {
	ID, Order, Customer string
}

// shipments records a shipment and, in the same transaction, asks two
// other systems to act on it: the notifications service's queue and a
// carrier's HTTP API (the destinations of ExampleNewRelay, or of the
// service's idem.Config.Outbox).
type shipments struct{}

func (shipments) Apply(ctx context.Context, tx pgx.Tx, s shipment) error {
	if _, err := tx.Exec(ctx, `INSERT INTO shipments (event_id, order_id) VALUES ($1, $2)`, s.ID, s.Order); err != nil {
		return err
	}
	body, _ := json.Marshal(s)
	// Index 0 and 1: the same two messages on every attempt, so a
	// re-publish is the same message (outbox.ID) to its receiver.
	return outbox.Enqueue(ctx, tx,
		outbox.Message{EventID: s.ID, Index: 0, To: "notifications", Key: s.Customer, Type: "SHIPPED", Body: body},
		outbox.Message{EventID: s.ID, Index: 1, To: "carrier", Key: s.Order, Body: body},
	)
}

// A handler sends messages to other systems by enqueueing them in the
// transaction it was given: they exist if and only if its effect commits,
// and a relay publishes them afterwards.
func ExampleEnqueue() {
	var h shipments
	_ = h.Apply // called by the consumer with the event's transaction
}

// relayShipments runs the relay of the shipments service's outbox, apart
// from its consumers: a bearer token for the carrier's API, and a
// signature over each request's body and idempotency key.
func relayShipments(ctx context.Context, pool *pgxpool.Pool, amqpURL, token string, key []byte, reg prometheus.Registerer) error {
	// docs:begin
	r, err := outbox.NewRelay(outbox.RelayConfig{
		Databases: []*pgxpool.Pool{pool}, // idem's tables applied (migrations.Apply)
		AMQPURL:   amqpURL,
		Destinations: map[string]outbox.Destination{
			"notifications": {Queue: "notifications.events"},
			"carrier": {
				URL:    "https://api.carrier.example/v1/shipments",
				Header: http.Header{"Authorization": {"Bearer " + token}},
				Request: func(req *http.Request) error { // optional: sign each request
					body, err := req.GetBody()
					if err != nil {
						return err
					}
					defer body.Close()
					mac := hmac.New(sha256.New, key)
					mac.Write([]byte(req.Header.Get("Idempotency-Key")))
					if _, err := io.Copy(mac, body); err != nil {
						return err
					}
					req.Header.Set("X-Signature", hex.EncodeToString(mac.Sum(nil)))
					return nil
				},
			},
		},
		Metrics: reg, // idem_outbox_*
	})
	if err != nil {
		return err
	}
	http.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if err := r.Ready(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
		}
	})
	return r.Run(ctx) // until ctx ends
	// docs:end
}

// A service can run its relay apart from its consumers: in a process of
// its own, or beside other work. (The front door runs one itself:
// idem.Config.Outbox.)
func ExampleNewRelay() {
	_ = relayShipments
	_, err := outbox.NewRelay(outbox.RelayConfig{})
	fmt.Println(err)
	// Output:
	// outbox: Databases is required
}
