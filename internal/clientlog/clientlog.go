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

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
)

// Route sends go-redis's and amqp091's log lines to log, at warning level,
// each with a component attribute. Both libraries keep one logger per
// process: the last Route wins.
func Route(log *slog.Logger) {
	redis.SetLogger(redisLog{log.With("component", "go-redis")})
	amqp.SetLogger(amqpLog{log.With("component", "amqp091")})
}

// redisLog and amqpLog adapt the client libraries' Printf loggers to slog,
// at warning level: what they log is a fault they recovered from.
type (
	redisLog struct{ log *slog.Logger }
	amqpLog  struct{ log *slog.Logger }
)

func (l redisLog) Printf(ctx context.Context, format string, v ...any) {
	l.log.WarnContext(ctx, strings.TrimSpace(fmt.Sprintf(format, v...)))
}

func (l amqpLog) Printf(format string, v ...any) {
	l.log.Warn(strings.TrimSpace(fmt.Sprintf(format, v...)))
}
