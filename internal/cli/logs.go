package cli

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
)

// newLogger returns the logger a config asks for, on w: logfmt ("text") or
// one JSON object per line ("json"), durations written as Go durations
// ("5ms", not 5000000). It also routes the log lines of go-redis and
// amqp091 (a failed dial, say) through it, so that in JSON mode every line
// the process writes is JSON.
func newLogger(w io.Writer, format string, level slog.Level) *slog.Logger {
	opts := &slog.HandlerOptions{Level: level, ReplaceAttr: durationsAsText}
	var h slog.Handler = slog.NewTextHandler(w, opts)
	if format == "json" {
		h = slog.NewJSONHandler(w, opts)
	}
	log := slog.New(h)
	redis.SetLogger(redisLog{log.With("component", "go-redis")})
	amqp.SetLogger(amqpLog{log.With("component", "amqp091")})
	return log
}

// durationsAsText writes a time.Duration attribute as its String form.
func durationsAsText(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		return slog.String(a.Key, a.Value.Duration().String())
	}
	return a
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
