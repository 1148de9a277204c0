package idem_test

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/idem"
)

// TestClientLibrariesLogThroughTheLogger: go-redis's own log lines (its
// failed dials to a Redis nobody listens on) reach Config.Logger, not
// stderr as plain text. Not parallel: the client libraries keep one logger
// per process, which each Service's New sets.
func TestClientLibrariesLogThroughTheLogger(t *testing.T) {
	pool, _ := testenv.Schema(t)
	var out testenv.LogBuffer
	svc, err := idem.New(idem.Config{
		Scope:     "greeter",
		Databases: []*pgxpool.Pool{pool},
		RedisURL:  fmt.Sprintf("redis://127.0.0.1:%d/0", testenv.FreePort(t)),
		Consumer:  consumer.Config{URL: testenv.AMQPURL(), Queue: testenv.Queue(t, testenv.AMQPURL())},
		Logger:    slog.New(slog.NewTextHandler(&out, nil)),
	}, greeting{})
	require.NoError(t, err)
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx) }()
	defer func() {
		stop()
		require.NoError(t, <-done)
	}()
	require.Eventually(t, func() bool { return strings.Contains(out.String(), "component=go-redis") },
		30*time.Second, 20*time.Millisecond, "go-redis's lines in the service's log")
}
