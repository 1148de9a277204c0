// Package clientlog routes the log lines of the client libraries (go-redis,
// amqp091: a failed dial, a pool's recovered fault) through a slog.Logger,
// so that they reach the service's logs in its format instead of stderr as
// plain text.
package clientlog

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
)

// Route sends go-redis's and amqp091's log lines to log, at warning level,
// each with a component attribute. Both libraries keep one logger per
// process: the last Route wins. Route is safe to call from any goroutine:
// the libraries' loggers are set once, and read the current log from an
// atomic pointer (services started side by side in one process, as tests
// do, would otherwise race on the libraries' globals).
func Route(log *slog.Logger) {
	current.Store(log)
	install.Do(func() {
		redis.SetLogger(redisLog{})
		amqp.SetLogger(amqpLog{})
	})
}

var (
	current atomic.Pointer[slog.Logger]
	install sync.Once
)

// redisLog and amqpLog adapt the client libraries' Printf loggers to slog,
// at warning level: what they log is a fault they recovered from.
type (
	redisLog struct{}
	amqpLog  struct{}
)

func (redisLog) Printf(ctx context.Context, format string, v ...any) {
	current.Load().WarnContext(ctx, strings.TrimSpace(fmt.Sprintf(format, v...)), "component", "go-redis")
}

func (amqpLog) Printf(format string, v ...any) {
	current.Load().Warn(strings.TrimSpace(fmt.Sprintf(format, v...)), "component", "amqp091")
}
