package consumer_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
)

// undecodable refuses every body, so that every event is dead-lettered on
// its first delivery.
type undecodable struct{ handlerFunc }

func (undecodable) Decode(consumer.Message) (guard.Event, []byte, error) {
	return guard.Event{}, nil, errors.New("not an event")
}

// TestALetterAboveTheFrameMaxIsCutNotAConnectionLost: a producer's headers
// fill most of a frame, which RabbitMQ takes; the dead letter adds idem's
// headers. Before, its header frame exceeded frame_max, RabbitMQ closed the
// publishing connection (FRAME_ERROR), and the message came back to do it
// again until the broker's delivery limit took it. Now the letter leaves
// out the producer's largest header, keeps idem's, and says what it left
// out; every client reads it.
func TestALetterAboveTheFrameMaxIsCutNotAConnectionLost(t *testing.T) {
	t.Parallel()
	r := startRig(t, undecodable{}, nil)
	conn, err := amqp.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	defer conn.Close()
	fm := conn.Config.FrameSize
	require.NoError(t, r.ch.PublishWithContext(context.Background(), "", r.queue, false, false, amqp.Publishing{
		MessageId: "evt_big", Body: []byte("{}"), Timestamp: time.Now(), DeliveryMode: amqp.Persistent,
		Headers: amqp.Table{"big": strings.Repeat("h", fm-100), "small": "s"},
	}))

	d := r.deadLetter() // read by a client that negotiated frame_max
	require.Equal(t, wire.ReasonDecode, d.Headers[wire.HeaderReason])
	require.Equal(t, "big", d.Headers[wire.HeaderHeadersDropped])
	require.NotContains(t, d.Headers, "big")
	require.Equal(t, "s", d.Headers["small"])
	require.Equal(t, r.queue, d.Headers[wire.HeaderQueue])
	require.Equal(t, "evt_big", d.MessageId)
	// The delivery is settled (acked) once the letter's publish is
	// confirmed, which can be after the letter was read here.
	require.Eventually(t, func() bool { return r.stats[guard.OutcomeDeadLettered.String()].Load() == 1 },
		10*time.Second, 10*time.Millisecond, "the delivery was not settled as dead-lettered")
	require.Zero(t, r.stats[wire.CounterReconnect].Load(), "no connection was lost")
	require.Equal(t, int64(1), r.stats[guard.OutcomeDeadLettered.String()].Load())
}

// TestARedeliveryAboveTheFrameMaxIsRead: a producer's headers fill a frame
// to within a few bytes of frame_max, which RabbitMQ takes; when the first
// attempt fails, the quorum queue delivers it again with x-delivery-count
// added, a header frame above frame_max. The consuming connection reads it
// (it was lost on every redelivery, the message coming back to do it again)
// and the second attempt applies it.
func TestARedeliveryAboveTheFrameMaxIsRead(t *testing.T) {
	t.Parallel()
	var attempts atomic.Int32
	r := startRig(t, handlerFunc{apply: func(ctx context.Context, tx pgx.Tx) error {
		if attempts.Add(1) == 1 {
			return errors.New("first attempt fails")
		}
		_, err := tx.Exec(ctx, `INSERT INTO ledger (event_id, user_id, amount) VALUES ('evt_wide', 'u', 1)`)
		return err
	}}, func(c *consumer.Config) { c.DeliveryLimit = 3 })
	conn, err := amqp.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	defer conn.Close()
	fm := conn.Config.FrameSize
	// The header frame: 8 bytes of framing, 14 of class, weight, body size
	// and flags, the message ID (1+8), the delivery mode (1) and the table
	// (4, then 1+3 for the key, 1+4 for the string's type and length):
	// 44 bytes and the value, 10 under frame_max.
	require.NoError(t, r.ch.PublishWithContext(context.Background(), "", r.queue, false, false, amqp.Publishing{
		MessageId: "evt_wide", Body: []byte("{}"), DeliveryMode: amqp.Persistent,
		Headers: amqp.Table{"big": strings.Repeat("h", fm-44-10)},
	}))
	require.Eventually(t, func() bool { return r.stats[guard.OutcomeProcessed.String()].Load() == 1 }, 20*time.Second, 20*time.Millisecond)
	require.Equal(t, int32(2), attempts.Load())
	require.Zero(t, r.stats[wire.CounterReconnect].Load(), "no connection was lost")
}
