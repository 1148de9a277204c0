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
		EventID: "evt_1", EventIDRead: true, PayloadHash: "ab", ShardKey: "user_1"}, m)
	require.Equal(t, "m_1", Parse(amqp.Delivery{MessageId: "m_1"}).EventID, "without the header, the message ID")
	require.False(t, Parse(amqp.Delivery{MessageId: "m_1"}).EventIDRead, "standing in for an event ID no consumer read")

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

// TestABrokersDeadLetterIsNotBelievedOnItsIdemHeaders: a message the broker
// dead-lettered (x-death) carries its producer's headers, x-idem-* ones
// included: none is read, and the x-death says why it died. A consumer's
// own dead letter (no x-death) is read in full.
func TestABrokersDeadLetterIsNotBelievedOnItsIdemHeaders(t *testing.T) {
	at := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	forged := amqp.Table{
		wire.HeaderReason: wire.ReasonBodyTooLarge, wire.HeaderError: "forged", wire.HeaderQueue: "other",
		wire.HeaderDeliveryCount: int64(9), wire.HeaderDeadLetteredAt: at.Add(-time.Hour), HeaderReplays: int64(7),
		wire.HeaderEventID: "evt_victim", wire.HeaderPayloadHash: "ab", wire.HeaderShardKey: "user_victim",
		wire.HeaderBodyBytes: int64(1 << 20),
	}
	h := amqp.Table{"x-death": []any{amqp.Table{"reason": "rejected", "queue": "pay", "time": at, "count": int64(1)}}}
	for k, v := range forged {
		h[k] = v
	}
	m := Parse(amqp.Delivery{Headers: h, MessageId: "m_1", Body: []byte("{}")})
	require.Equal(t, Message{D: m.D, ByBroker: true, Reason: "rejected", Queue: "pay", DeadLetteredAt: at, EventID: "m_1"}, m)
	require.False(t, m.Truncated(), "a forged x-idem-body-bytes")

	m = Parse(amqp.Delivery{Headers: forged, MessageId: "m_1", Body: []byte("{}")})
	require.False(t, m.ByBroker)
	require.Equal(t, "evt_victim", m.EventID, "a consumer's dead letter is believed")
	require.True(t, m.Truncated())
	require.Equal(t, int64(1<<20), m.BodyBytes)
}

func TestPublishingKeepsTheEventAndDropsTheDiagnosis(t *testing.T) {
	ts := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)
	d := amqp.Delivery{
		MessageId: "m1", ContentType: "application/json", Timestamp: ts, Body: []byte(`{"eventId":"e"}`),
		Headers: amqp.Table{
			"trace-id": "abc", wire.HeaderReason: "handler_failed", wire.HeaderError: "boom",
			wire.HeaderDeliveryCount: int64(5), "x-delivery-count": int64(3), HeaderReplays: int64(1),
			HeaderReplayID: "old-1",
		},
	}
	p := Publishing(Parse(d))
	require.Equal(t, amqp.Table{"trace-id": "abc", HeaderReplays: int64(2)}, p.Headers,
		"the producer's headers stay; the budget and the diagnosis start over")
	d.Headers["x-death"] = []any{amqp.Table{"reason": "delivery_limit"}}
	d.Headers["x-first-death-reason"] = "delivery_limit"
	require.Equal(t, amqp.Table{"trace-id": "abc", HeaderReplays: int64(1)}, Publishing(Parse(d)).Headers,
		"the broker's dead letter: its x-idem-replays is the producer's, and counts from 0")
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
