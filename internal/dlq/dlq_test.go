package dlq

import (
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/wire"
)

func TestParseReadsTheConsumersHeadersAndTheBrokers(t *testing.T) {
	at := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	m := Parse(amqp.Delivery{Headers: amqp.Table{
		wire.HeaderReason: "handler_failed", wire.HeaderError: "boom", wire.HeaderQueue: "q",
		wire.HeaderDeliveryCount: int64(5), wire.HeaderDeadLetteredAt: at, HeaderReplays: int64(2),
		wire.HeaderEventID: "evt_1", wire.HeaderPayloadHash: "ab", wire.HeaderShardKey: "user_1",
	}, MessageId: "m_1"})
	require.Equal(t, Message{D: m.D, Reason: "handler_failed", Error: "boom", Queue: "q", Attempts: 5, Replays: 2, DeadLetteredAt: at,
		EventID: "evt_1", PayloadHash: "ab", ShardKey: "user_1"}, m)
	require.Equal(t, "m_1", Parse(amqp.Delivery{MessageId: "m_1"}).EventID, "without the header, the message ID")

	// The broker's own dead letter: x-delivery-limit reached.
	m = Parse(amqp.Delivery{Headers: amqp.Table{
		"x-delivery-count": int64(20),
		"x-death":          []any{amqp.Table{"reason": "delivery_limit", "queue": "q", "time": at, "count": int64(1)}},
	}})
	require.Equal(t, wire.ReasonDeliveryLimit, m.Reason)
	require.Equal(t, "q", m.Queue)
	require.Equal(t, at, m.DeadLetteredAt)
	require.Equal(t, int64(20), m.Attempts)

	require.Equal(t, "unknown", Parse(amqp.Delivery{}).Reason)
}

func TestPublishingKeepsTheEventAndDropsTheDiagnosis(t *testing.T) {
	ts := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)
	d := amqp.Delivery{
		MessageId: "m1", ContentType: "application/json", Timestamp: ts, Body: []byte(`{"eventId":"e"}`),
		Headers: amqp.Table{
			"trace-id": "abc", wire.HeaderReason: "handler_failed", wire.HeaderError: "boom",
			wire.HeaderDeliveryCount: int64(5), "x-delivery-count": int64(3), HeaderReplays: int64(1),
			"x-death": []any{amqp.Table{"reason": "delivery_limit"}}, HeaderReplayID: "old-1",
		},
	}
	p := Publishing(Parse(d))
	require.Equal(t, amqp.Table{"trace-id": "abc", HeaderReplays: int64(2)}, p.Headers,
		"the producer's headers stay; the budget and the diagnosis start over")
	require.Equal(t, ts, p.Timestamp, "the event's time travels with the replay")
	require.Equal(t, "m1", p.MessageId)
	require.Equal(t, d.Body, p.Body)
	require.Equal(t, amqp.Persistent, p.DeliveryMode)
}

// TestReplayGoesBackToItsPartition: a dead letter is replayed onto the
// partition queue it died in, so that its key's events keep their queue; one
// that names no queue of the topology goes to the first.
func TestReplayGoesBackToItsPartition(t *testing.T) {
	topo := broker.TopologyFor("pay", 20)
	topo.Partitions = 4
	r := &Replayer{topo: topo}
	require.Equal(t, "pay.2", r.Target(Message{Queue: "pay.2"}))
	require.Equal(t, "pay.0", r.Target(Message{Queue: "other"}))
	require.Equal(t, "pay.0", r.Target(Message{}))
	r.topo.Partitions = 0
	require.Equal(t, "pay", r.Target(Message{Queue: "pay"}))
}
