package idem

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/consumer"
)

// redisTLS is the TLS configuration a service gives the Redis client it
// asks New to open: the CA that signs the servers' certificates and a
// client certificate.
func redisTLS(caFile, certFile, keyFile string) (*tls.Config, error) {
	// docs:begin
	ca, err := os.ReadFile(caFile)
	if err != nil {
		return nil, err
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(ca) {
		return nil, fmt.Errorf("%s holds no PEM certificate", caFile)
	}
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, err
	}
	return &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}, nil
	// docs:end
}

// TestRedisTLSReachesATLSServer: with Config.RedisTLS, the client New opens
// from RedisURL speaks TLS to a redis-server of the test's own that asks
// for a client certificate; trusting another CA, it cannot.
func TestRedisTLSReachesATLSServer(t *testing.T) {
	trusted, err := sandbox.NewPKI(t.TempDir())
	require.NoError(t, err)
	unknown, err := sandbox.NewPKI(t.TempDir())
	require.NoError(t, err)
	srv, tlsPort, err := sandbox.StartRedisTLS(t.TempDir(), trusted)
	require.NoError(t, err)
	t.Cleanup(srv.Kill)
	pool, _ := testenv.Schema(t)
	ping := func(p *sandbox.PKI) error {
		t.Helper()
		tc, err := redisTLS(p.CAFile, trusted.ClientCertFile, trusted.ClientKeyFile)
		require.NoError(t, err)
		svc, err := New(Config{Scope: "greeter", DatabaseURL: pool.Config().ConnString(),
			RedisURL: fmt.Sprintf("redis://127.0.0.1:%d/0", tlsPort), RedisTLS: tc,
			Consumer: consumer.Config{URL: testenv.AMQPURL(), Queue: "unused"}, Logger: testenv.Logger(t)}, idleHandler{})
		require.NoError(t, err)
		defer svc.close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return svc.rdb.Ping(ctx).Err()
	}
	require.NoError(t, ping(trusted))
	require.ErrorContains(t, ping(unknown), "certificate")
}

// TestNewWarnsOfInsecureLinksOnce: New logs one line per link that is
// plaintext or does not verify the server, naming the setting and not the
// URL; a loopback link is not warned about.
func TestNewWarnsOfInsecureLinksOnce(t *testing.T) {
	var out testenv.LogBuffer
	svc, err := New(Config{Scope: "greeter",
		DatabaseURL: "postgres://u:SecretPw99@db.example.com/app?sslmode=require",
		RedisURL:    "rediss://u:SecretPw99@cache.example.com:6379/0?skip_verify=true",
		Consumer:    consumer.Config{URL: "amqp://u:SecretPw99@mq.example.com:5672/", Queue: "q"},
		Logger:      slog.New(slog.NewTextHandler(&out, nil)),
	}, idleHandler{})
	require.NoError(t, err)
	svc.close()
	log := out.String()
	for _, want := range []string{"DatabaseURL: sslmode=require", "RedisURL: TLS without certificate checks", "Consumer.URL: amqp:// is plaintext"} {
		require.Equal(t, 1, strings.Count(log, want), "%q once in:\n%s", want, log)
	}
	require.NotContains(t, log, "SecretPw99")
	require.NotContains(t, log, "example.com")

	var quiet testenv.LogBuffer
	svc, err = New(Config{Scope: "greeter", DatabaseURL: "postgres://u@127.0.0.1/app?sslmode=disable", RedisURL: "redis://127.0.0.1:6379/0",
		Consumer: consumer.Config{URL: "amqp://u:p@localhost:5672/", Queue: "q"}, Logger: slog.New(slog.NewTextHandler(&quiet, nil))}, idleHandler{})
	require.NoError(t, err)
	svc.close()
	require.NotContains(t, quiet.String(), "insecure link")
}
