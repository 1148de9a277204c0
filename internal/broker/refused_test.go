package broker_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
)

// TestARefusalLastsOnlyOnceItRepeats: refusals in a row last once there
// were RefusedTries of them over RefusedFor; a dropped handshake, a vhost
// refused and a connection limit count alike, anything else starts over.
func TestARefusalLastsOnlyOnceItRepeats(t *testing.T) {
	t0 := time.Unix(1_000_000, 0)
	limit := &amqp.Error{Code: amqp.NotAllowed, Reason: "connection limit", Server: true}
	dropped := fmt.Errorf("node 1 of 2: %w", amqp.ErrCredentials)
	down := &net.OpError{Op: "dial", Err: errors.New("connection refused")}
	steps := []struct {
		err    error
		after  time.Duration
		lasted bool
	}{
		{dropped, 0, false},
		{amqp.ErrVhost, time.Second, false},
		{limit, 2 * time.Second, false}, // three, but within RefusedFor
		{dropped, 3 * time.Second, true},
		{down, 4 * time.Second, false}, // the broker is down: start over
		{dropped, 5 * time.Second, false},
		{dropped, 9 * time.Second, false}, // long enough, but two
		{errors.Join(down, dropped), 10 * time.Second, true},
		{nil, 11 * time.Second, false},
		{dropped, 12 * time.Second, false},
	}
	var r broker.Refusals
	for i, s := range steps {
		require.Equal(t, s.lasted, r.Add(s.err, t0.Add(s.after)), "step %d: %v", i, s.err)
	}
	require.False(t, broker.IsRefused(down))
	require.False(t, broker.IsRefused(&amqp.Error{Code: amqp.PreconditionFailed}))
}

// TestDialAtStartWaitsOutADroppedHandshake: a tool's first dial whose
// handshakes are dropped a few times connects once they pass; dropped for
// good, it gives up with ErrRefused after RefusedFor, and at once when its
// context ends.
func TestDialAtStartWaitsOutADroppedHandshake(t *testing.T) {
	proxy, url := testenv.AMQPCut(t)
	startOk := sandbox.Cut{Dir: sandbox.ToServer, Method: sandbox.ConnectionStartOk}
	proxy.Arm(startOk, startOk, startOk, startOk)
	conn, _, err := broker.DialAtStart(context.Background(), []string{url}, 0, amqp.Config{})
	require.NoError(t, err)
	conn.Close()
	require.Equal(t, 4, proxy.Fired())

	for range 1000 {
		proxy.Arm(startOk)
	}
	began := time.Now()
	_, _, err = broker.DialAtStart(context.Background(), []string{url}, 0, amqp.Config{})
	require.ErrorIs(t, err, broker.ErrRefused)
	require.ErrorContains(t, err, "check the URL's user, password and vhost")
	require.GreaterOrEqual(t, time.Since(began), broker.RefusedFor)

	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	_, _, err = broker.DialAtStart(ctx, []string{url}, 0, amqp.Config{})
	require.True(t, broker.IsRefused(err), "%v", err)
	require.NotErrorIs(t, err, broker.ErrRefused)
	require.ErrorContains(t, err, "dropped it during the handshake")
}
