package idem_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard/redistier"
	"github.com/idemhq/idem/pkg/idem"
)

// TestARedisDatabaseTheServerLacksIsRefusedAtStart: a RedisURL naming a
// database number beyond the server's is a setting to fix: Run stops at
// start naming RedisURL (it was taken for a Redis that is down, forever).
// A Redis that is merely down still only costs a warning: the service
// consumes on Postgres alone.
func TestARedisDatabaseTheServerLacksIsRefusedAtStart(t *testing.T) {
	t.Parallel()
	_, dbURL := testenv.Schema(t, testenv.Effects)
	u, err := url.Parse(testenv.RedisURL())
	require.NoError(t, err)
	u.Path = "/9999"
	errc := reviewStart(t, idem.Config{Scope: "pay", DatabaseURL: dbURL, RedisURL: u.String(),
		Consumer: consumer.Config{URL: testenv.AMQPURL(), Queue: testenv.Queue(t, testenv.AMQPURL())}})
	select {
	case err := <-errc:
		require.ErrorIs(t, err, redistier.ErrNoSuchDatabase)
		require.ErrorContains(t, err, "RedisURL")
		require.ErrorContains(t, err, "SELECT 9999")
	case <-time.After(30 * time.Second):
		t.Fatal("the service started on a Redis database the server lacks")
	}

	down := fmt.Sprintf("redis://127.0.0.1:%d/0", testenv.FreePort(t))
	svc, err := idem.New(idem.Config{Scope: "pay", DatabaseURL: dbURL, RedisURL: down, Logger: slog.New(slog.DiscardHandler),
		Consumer: consumer.Config{URL: testenv.AMQPURL(), Queue: testenv.Queue(t, testenv.AMQPURL())}}, ledgerHandler{})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx) }()
	require.Eventually(t, func() bool {
		select {
		case err := <-done:
			t.Fatalf("Run returned with Redis down: %v", err)
		default:
		}
		return svc.Stats().Consuming
	}, 30*time.Second, 20*time.Millisecond, "the service never consumed with Redis down")
	cancel()
	require.NoError(t, <-done)
}
