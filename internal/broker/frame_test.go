package broker_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/wire"
)

// withFrame returns m with a header "big" sized so that its header frame,
// with the publish ID the publisher adds to its publish number seq (its
// ID, 16 hex digits, "-" and seq), is size bytes.
func withFrame(t *testing.T, m broker.Message, seq, size int) broker.Message {
	t.Helper()
	p := m.Publishing
	p.Headers = amqp.Table{broker.HeaderPublishID: strings.Repeat("0", 16) + "-" + strconv.Itoa(seq), "big": ""}
	pad := size - broker.HeaderFrameSize(p)
	require.GreaterOrEqual(t, pad, 0)
	m.Headers = amqp.Table{"big": strings.Repeat("h", pad)}
	return m
}

// TestAHeaderFrameOverFrameMaxIsInvalidNotALostConnection: RabbitMQ closes
// the whole connection (FRAME_ERROR) on a header frame above frame_max, and
// with it every publish in flight; one a few bytes over it takes, but no
// client that negotiated frame_max can read. The publisher refuses both as
// Invalid, and goes on; a frame of exactly frame_max goes out, and a client
// reads it back (so the publisher measures the frame as amqp091 encodes
// it, not less).
func TestAHeaderFrameOverFrameMaxIsInvalidNotALostConnection(t *testing.T) {
	t.Parallel()
	q := declare(t, nil)
	p := openPublisher(t, testenv.AMQPURL(), broker.PublisherOptions{})
	fm := p.FrameMax()
	require.Positive(t, fm)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	exact := withFrame(t, msg(q, "exact"), 1, fm)
	unreadable := withFrame(t, msg(q, "unreadable"), 2, fm+1)
	over := withFrame(t, msg(q, "over"), 3, fm+100)
	rs := p.Publish(ctx, exact, unreadable, over, msg(q, "after"))
	require.Equal(t, []broker.Outcome{broker.Confirmed, broker.Invalid, broker.Invalid, broker.Confirmed}, outcomes(rs), "%v", rs)
	require.ErrorContains(t, rs[2].Err, "frame_max")
	require.NoError(t, p.Err(), "the connection stays open")
	require.Equal(t, []broker.Outcome{broker.Confirmed}, outcomes(p.Publish(ctx, msg(q, "later"))))

	conn, err := amqp.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	var bodies []string
	for {
		d, ok, err := ch.Get(q, true)
		require.NoError(t, err, "a frame of frame_max is read back")
		if !ok {
			break
		}
		bodies = append(bodies, string(d.Body))
	}
	require.Equal(t, []string{"exact", "after", "later"}, bodies)
}

// TestKeepLeavesOutTheLargestOtherHeadersAndSaysSo: a message that may
// lose headers (a dead letter, a replay) loses the largest of those Keep
// refuses, only as many as the frame needs, and names them; those Keep
// holds stay.
func TestKeepLeavesOutTheLargestOtherHeadersAndSaysSo(t *testing.T) {
	t.Parallel()
	q := declare(t, nil)
	p := openPublisher(t, testenv.AMQPURL(), broker.PublisherOptions{})
	fm := p.FrameMax()
	m := msg(q, "letter")
	m.Headers = amqp.Table{
		"large":             strings.Repeat("l", fm*3/4),
		"medium":            strings.Repeat("m", fm/4),
		"small":             "s",
		wire.HeaderReason:   "decode_error",
		wire.HeaderError:    strings.Repeat("e", 1000),
		"x-idem-event-id":   "evt_1",
		"x-idem-some-large": strings.Repeat("i", 2000),
	}
	m.Keep = wire.Ours
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rs := p.Publish(ctx, m)
	require.Equal(t, broker.Confirmed, rs[0].Outcome, "%v", rs[0].Err)
	require.Equal(t, []string{"large"}, rs[0].Dropped)

	conn, err := amqp.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	d, ok, err := ch.Get(q, true)
	require.NoError(t, err)
	require.True(t, ok)
	require.NotContains(t, d.Headers, "large")
	require.Equal(t, "large", d.Headers[wire.HeaderHeadersDropped])
	for _, k := range []string{"medium", "small", wire.HeaderReason, wire.HeaderError, "x-idem-event-id", "x-idem-some-large"} {
		require.Equal(t, m.Headers[k], d.Headers[k], k)
	}

	// What Keep holds may not be dropped: too large by itself, it is
	// refused, and nothing is lost.
	m.Headers = amqp.Table{wire.HeaderError: strings.Repeat("e", fm)}
	rs = p.Publish(ctx, m, msg(q, "after"))
	require.Equal(t, []broker.Outcome{broker.Invalid, broker.Confirmed}, outcomes(rs))
	require.NoError(t, p.Err())
}

// deadLettered puts into a queue of the test's own a message that the
// broker dead-lettered from another queue, with headers that filled its
// frame all but spare bytes; x-death then takes it above frame_max.
func deadLettered(t *testing.T, spare int) (queue string, fm int) {
	t.Helper()
	url := testenv.AMQPURL()
	target := declare(t, nil)
	source := declare(t, amqp.Table{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": target})
	conn, err := amqp.Dial(url)
	require.NoError(t, err)
	defer conn.Close()
	fm = conn.Config.FrameSize
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	p := amqp.Publishing{MessageId: "big", Body: []byte("body"), DeliveryMode: amqp.Persistent, Headers: amqp.Table{"big": ""}}
	p.Headers["big"] = strings.Repeat("h", fm-spare-broker.HeaderFrameSize(p))
	dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), "", source, true, false, p)
	require.NoError(t, err)
	require.True(t, dc.Wait())
	d, ok, err := ch.Get(source, false)
	require.NoError(t, err)
	require.True(t, ok)
	require.NoError(t, d.Nack(false, false)) // the broker dead-letters it, adding x-death
	require.Eventually(t, func() bool { return testenv.QueueDepth(t, url, target) == 1 }, 10*time.Second, 10*time.Millisecond)
	return target, fm
}

// TestAConnectionReadsWhatTheBrokerDelivers: a letter the broker
// dead-lettered can come in above frame_max, which amqp091 refuses (the
// connection ends, the letter goes back, and nothing can read it). A
// connection dialled with FrameSize ReadFrameMax reads it, and still
// publishes within the broker's frame_max.
func TestAConnectionReadsWhatTheBrokerDelivers(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q, fm := deadLettered(t, 50)

	plain, err := amqp.Dial(url)
	require.NoError(t, err)
	defer plain.Close()
	ch, err := plain.Channel()
	require.NoError(t, err)
	_, _, err = ch.Get(q, false)
	require.Error(t, err, "the letter is above frame_max: a plain client cannot read it")

	conn, _, err := broker.Dial([]string{url}, 0, amqp.Config{FrameSize: broker.ReadFrameMax})
	require.NoError(t, err)
	defer conn.Close()
	require.Equal(t, fm, conn.Config.FrameSize, "its writes keep to the broker's frame_max")
	ch, err = conn.Channel()
	require.NoError(t, err)
	var d amqp.Delivery
	require.Eventually(t, func() bool { // the plain client's get went back
		var ok bool
		d, ok, err = ch.Get(q, false)
		require.NoError(t, err)
		return ok
	}, 10*time.Second, 10*time.Millisecond)
	require.Equal(t, "big", d.MessageId)
	require.Contains(t, d.Headers, "x-death")
	require.Greater(t, broker.HeaderFrameSize(amqp.Publishing{Headers: d.Headers, MessageId: d.MessageId, DeliveryMode: d.DeliveryMode}), fm)
	require.NoError(t, d.Ack(false))

	// A body of several frames goes out split by the broker's frame_max.
	require.NoError(t, ch.Confirm(false))
	body := strings.Repeat("b", 3*fm)
	dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), "", q, true, false, amqp.Publishing{Body: []byte(body)})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	acked, err := dc.WaitContext(ctx)
	require.NoError(t, err)
	require.True(t, acked)
	got, ok, err := ch.Get(q, true)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, body, string(got.Body))
	require.False(t, conn.IsClosed())
}
