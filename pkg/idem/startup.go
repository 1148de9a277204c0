package idem

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"time"

	"github.com/idemhq/idem/internal/pgerr"
	"github.com/idemhq/idem/pkg/consumer"
)

// waitPostgres runs fn (what names it in logs) until it succeeds. While
// PostgreSQL is unreachable or starting it retries, logging each wait, for up
// to timeout; an error that cannot fix itself (a bad password, a missing
// database or schema, a failing migration) ends it at once.
func waitPostgres(ctx context.Context, timeout time.Duration, what string, log *slog.Logger, fn func(context.Context) error) error {
	deadline := time.Now().Add(timeout)
	b := consumer.Backoff{Min: 200 * time.Millisecond, Max: 5 * time.Second}
	for attempt := 1; ; attempt++ {
		actx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err := fn(actx)
		timedOut := actx.Err() != nil
		cancel()
		switch {
		case err == nil:
			return nil
		case ctx.Err() != nil:
			return ctx.Err()
		case !timedOut && !pgerr.IsTransient(err):
			return fmt.Errorf("%s failed, and retrying cannot fix it (check the database URL and the database): %w", what, err)
		case time.Now().After(deadline):
			return fmt.Errorf("PostgreSQL was not reachable within the start-up timeout (%s) for %s: %w", timeout, what, err)
		}
		d := b.Delay(attempt)
		log.Warn("waiting for PostgreSQL", "for", what, "err", err, "retry_in", d, "gives_up_in", time.Until(deadline).Round(time.Second))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(d):
		}
	}
}

// hasParam reports whether a PostgreSQL URL or DSN sets param.
func hasParam(dsn, param string) bool {
	if u, err := url.Parse(dsn); err == nil && u.Scheme != "" {
		return u.Query().Has(param)
	}
	return strings.Contains(dsn, param+"=")
}
