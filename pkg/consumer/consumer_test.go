package consumer

import (
	"errors"
	"fmt"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
)

func TestBackoffDoublesWithJitterUpToMax(t *testing.T) {
	b := Backoff{Min: 100 * time.Millisecond, Max: time.Second}
	for n, ceil := range map[int]time.Duration{1: 100 * time.Millisecond, 2: 200 * time.Millisecond, 4: 800 * time.Millisecond, 5: time.Second, 50: time.Second} {
		for range 100 {
			d := b.Delay(n)
			require.GreaterOrEqual(t, d, ceil/2, "attempt %d", n)
			require.LessOrEqual(t, d, ceil, "attempt %d", n)
		}
	}
}

func TestDeliveryCountComesOnlyFromTheBroker(t *testing.T) {
	require.Equal(t, 0, deliveryCount(amqp.Delivery{}))
	require.Equal(t, 1, deliveryCount(amqp.Delivery{Redelivered: true}))
	require.Equal(t, 3, deliveryCount(amqp.Delivery{Headers: amqp.Table{"x-delivery-count": int64(3)}, Redelivered: true}))
	// A publisher-set header on a first delivery spends nothing.
	require.Equal(t, 0, deliveryCount(amqp.Delivery{Headers: amqp.Table{"x-delivery-count": int32(7)}}))
	require.Equal(t, 0, deliveryCount(amqp.Delivery{Headers: amqp.Table{"x-delivery-count": int64(7)}}))
	// A redelivery is at least the first redelivery.
	require.Equal(t, 1, deliveryCount(amqp.Delivery{Headers: amqp.Table{"x-delivery-count": int64(0)}, Redelivered: true}))
}

func TestRejectCarriesReasonThroughWrapping(t *testing.T) {
	err := errors.Join(errors.New("context"), Reject("invalid_field", errors.New("amount: negative")))
	reason, ok := rejectReason(err)
	require.True(t, ok)
	require.Equal(t, "invalid_field", reason)
	_, ok = rejectReason(errors.New("plain"))
	require.False(t, ok)
}

func TestConfigValidationNamesTheField(t *testing.T) {
	cases := map[string]Config{
		"URL":                 {Queue: "q"},
		"Queue":               {URL: "amqp://"},
		"Workers":             {URL: "amqp://", Queue: "q", Workers: -1},
		"BrokerDeliveryLimit": {URL: "amqp://", Queue: "q", DeliveryLimit: 9, BrokerDeliveryLimit: 3},
		"RetryBackoff":        {URL: "amqp://", Queue: "q", RetryBackoff: Backoff{Min: time.Second, Max: time.Millisecond}},
		"Retention":           {URL: "amqp://", Queue: "q", Retention: -time.Second},
		"Prefetch":            {URL: "amqp://", Queue: "q", Prefetch: 65536},
		"Untimed":             {URL: "amqp://", Queue: "q", Untimed: "sometimes"},
		"StoreHold":           {URL: "amqp://", Queue: "q", StoreHold: -time.Second},
		"ClockSkew":           {URL: "amqp://", Queue: "q", ClockSkew: -time.Second},
		"MaxBodyBytes":        {URL: "amqp://", Queue: "q", MaxBodyBytes: 100},
	}
	for field, cfg := range cases {
		cfg.setDefaults()
		require.ErrorContains(t, cfg.validate(), field)
	}
	ok := Config{URL: "amqp://", Queue: "q"}
	ok.setDefaults()
	require.NoError(t, ok.validate())
	bad := Config{URL: "http://guest:guest@127.0.0.1:5672/", Queue: "q"}
	bad.setDefaults()
	require.ErrorContains(t, bad.validate(), "consumer: URL")
}

func TestOnlyARefusedDeclarationIsFatal(t *testing.T) {
	refused := &amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit'"}
	require.True(t, isBadTopology(&declareError{fmt.Errorf("declare queue: %w", refused)}))
	ackTimeout := &amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - delivery acknowledgement on channel 1 timed out"}
	require.False(t, isBadTopology(fmt.Errorf("consume channel closed: %w", ackTimeout)))
	require.False(t, isBadTopology(&declareError{errors.New("dial tcp: connection refused")}))
}
