package cli

import (
	"io"
	"log/slog"

	"github.com/idemhq/idem/internal/clientlog"
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
	clientlog.Route(log)
	return log
}

// durationsAsText writes a time.Duration attribute as its String form.
func durationsAsText(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		return slog.String(a.Key, a.Value.Duration().String())
	}
	return a
}
