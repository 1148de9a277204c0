package cli_test

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/cli"
)

// TestConfigWarnsOfInsecureLinks: idem config prints a warning per link
// that is plaintext or does not verify the server, naming the setting and
// not quoting the URL (or its password); links to loopback are quiet.
func TestConfigWarnsOfInsecureLinks(t *testing.T) {
	t.Setenv("AMQP_URL", "amqp://u:SecretPw99@mq.example.com:5672/")
	t.Setenv("REDIS_URL", "rediss://u:SecretPw99@cache.example.com:6380/0?skip_verify=true")
	t.Setenv("DATABASE_URL", "postgres://u:SecretPw99@db.example.com:5432/app")
	var out, errs bytes.Buffer
	require.NoError(t, cli.Run(context.Background(), []string{"config"}, &out, &errs), errs.String())
	for _, want := range []string{
		"warning: amqp_url: amqp:// is plaintext; use amqps://",
		"warning: redis_url: TLS without certificate checks (skip_verify=true)",
		"warning: database_url: sslmode=prefer (the default when unset)",
	} {
		require.Equal(t, 1, strings.Count(out.String(), want), "%q in:\n%s", want, out.String())
	}
	require.NotContains(t, out.String()+errs.String(), "SecretPw99")

	t.Setenv("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
	t.Setenv("REDIS_URL", "redis://127.0.0.1:6379/0")
	t.Setenv("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	out.Reset()
	require.NoError(t, cli.Run(context.Background(), []string{"config"}, &out, &errs), errs.String())
	require.NotContains(t, out.String(), "plaintext")
}
