package broker_test

import (
	"context"
	"net"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
)

// TestADialEndsWithItsContext: a broker that takes the connection and says
// nothing (a link gone silent during an outage) holds a handshake for the
// dial's own 30 s; the context ending ends it at once, for the consumers'
// and relays' dial (DialContext) as for the tools' (DialAtStart).
func TestADialEndsWithItsContext(t *testing.T) {
	for name, dial := range map[string]func(ctx context.Context, url string) error{
		"DialContext": func(ctx context.Context, url string) error {
			_, _, err := broker.DialContext(ctx, []string{url}, 0, amqp.Config{})
			return err
		},
		"DialAtStart": func(ctx context.Context, url string) error {
			_, _, err := broker.DialAtStart(ctx, []string{url}, 0, amqp.Config{})
			return err
		},
	} {
		t.Run(name, func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			defer ln.Close()
			accepted := make(chan net.Conn, 1)
			go func() {
				c, err := ln.Accept()
				if err == nil {
					accepted <- c // and never answer
				}
			}()

			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- dial(ctx, "amqp://guest:guest@"+ln.Addr().String()+"/") }()
			select {
			case c := <-accepted:
				defer c.Close()
			case <-time.After(10 * time.Second):
				t.Fatal("the dial never reached the listener")
			}
			cancel()
			select {
			case err := <-done:
				require.Error(t, err)
			case <-time.After(5 * time.Second):
				t.Fatal("the dial went on after its context ended")
			}
		})
	}
}
