package config

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/tlscheck"
)

// pkis makes the test's CA (whose server certificate the service serves)
// and a second, unknown one.
func pkis(t *testing.T) (trusted, unknown *sandbox.PKI) {
	t.Helper()
	trusted, err := sandbox.NewPKI(t.TempDir())
	require.NoError(t, err)
	unknown, err = sandbox.NewPKI(t.TempDir())
	require.NoError(t, err)
	return trusted, unknown
}

// TestPostgresTLS: against a PostgreSQL of the test's own with ssl=on,
// sslmode=verify-full with the test's CA connects and runs a statement over
// TLS; with an unknown CA it is refused; sslmode=prefer (what a URL without
// sslmode gets) accepts the same untrusted certificate, which is why idem
// warns about it (tlscheck reads the mode from pgx's parsed config).
func TestPostgresTLS(t *testing.T) {
	trusted, unknown := pkis(t)
	pg, err := sandbox.StartPostgresTLS("", trusted)
	if errors.Is(err, sandbox.ErrNoInitdb) {
		t.Skip(err)
	}
	require.NoError(t, err)
	t.Cleanup(pg.Remove)
	base := fmt.Sprintf("postgres://postgres@%%s:%d/postgres?connect_timeout=10&", pg.Port)
	connect := func(url string) (*pgx.Conn, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		return pgx.Connect(ctx, url)
	}
	ssl := func(c *pgx.Conn) bool {
		var on bool
		require.NoError(t, c.QueryRow(context.Background(), `SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()`).Scan(&on))
		return on
	}
	for _, host := range []string{"127.0.0.1", "localhost"} {
		c, err := connect(fmt.Sprintf(base, host) + "sslmode=verify-full&sslrootcert=" + trusted.CAFile)
		require.NoError(t, err, "verify-full with the server's CA, host %s", host)
		require.True(t, ssl(c), "verify-full connection is TLS")
		require.NoError(t, c.Close(context.Background()))
	}
	_, err = connect(fmt.Sprintf(base, "127.0.0.1") + "sslmode=verify-full&sslrootcert=" + unknown.CAFile)
	require.Error(t, err, "verify-full with an unknown CA must be refused")
	require.Contains(t, err.Error(), "certificate")

	prefer := fmt.Sprintf(base, "127.0.0.1") + "sslrootcert=" + unknown.CAFile // no sslmode: prefer
	c, err := connect(prefer)
	require.NoError(t, err, "prefer accepts a certificate it cannot verify")
	require.NoError(t, c.Close(context.Background()))
	pc, err := pgconn.ParseConfig(prefer)
	require.NoError(t, err)
	require.Equal(t, "prefer", tlscheck.PostgresMode(pc))
	// The same URL to a host off this machine is warned about, naming the
	// setting and the mode, not the URL.
	pc.Host = "db.example.com"
	for i := range pc.Fallbacks {
		pc.Fallbacks[i].Host = "db.example.com"
	}
	w := tlscheck.Postgres("database_url", pc)
	require.Contains(t, w, "database_url: sslmode=prefer")
	require.NotContains(t, w, "postgres://")
}

// TestRedisTLS: against a redis-server of the test's own with a TLS port
// that asks for a client certificate, the client idem consume builds from
// rediss:// and redis.tls_* pings it; without the client certificate, or
// trusting another CA, it cannot.
func TestRedisTLS(t *testing.T) {
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Skip("redis-server not installed")
	}
	// A build without TLS refuses the directive itself; one with TLS
	// fails later, on the missing certificate.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out, _ := exec.CommandContext(ctx, "redis-server", "--port", "0", "--tls-port", "1", "--tls-cert-file", "/nonexistent",
		"--tls-key-file", "/nonexistent", "--tls-ca-cert-file", "/nonexistent").CombinedOutput()
	if strings.Contains(string(out), "Bad directive") {
		t.Skipf("this redis-server was built without TLS:\n%s", out)
	}
	require.Contains(t, string(out), "TLS", "redis-server's answer to a TLS port with no certificate")
	trusted, unknown := pkis(t)
	srv, tlsPort, err := sandbox.StartRedisTLS(t.TempDir(), trusted)
	require.NoError(t, err)
	t.Cleanup(srv.Kill)
	url := fmt.Sprintf("rediss://127.0.0.1:%d/0", tlsPort)
	ping := func(env map[string]string) error {
		t.Helper()
		env["REDIS_URL"] = url
		cfg, err := load(t, "", env)
		require.NoError(t, err)
		rdb, err := cfg.RedisClient()
		require.NoError(t, err)
		defer rdb.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return rdb.Ping(ctx).Err()
	}
	require.NoError(t, ping(map[string]string{"IDEM_REDIS_TLS_CA_FILE": trusted.CAFile,
		"IDEM_REDIS_TLS_CERT_FILE": trusted.ClientCertFile, "IDEM_REDIS_TLS_KEY_FILE": trusted.ClientKeyFile}))
	require.Error(t, ping(map[string]string{"IDEM_REDIS_TLS_CA_FILE": trusted.CAFile}), "no client certificate")
	err = ping(map[string]string{"IDEM_REDIS_TLS_CA_FILE": unknown.CAFile,
		"IDEM_REDIS_TLS_CERT_FILE": trusted.ClientCertFile, "IDEM_REDIS_TLS_KEY_FILE": trusted.ClientKeyFile})
	require.ErrorContains(t, err, "certificate", "an unknown CA must be refused")
	err = ping(map[string]string{"IDEM_REDIS_TLS_CA_FILE": trusted.CAFile, "IDEM_REDIS_TLS_SERVER_NAME": "cache.example.com",
		"IDEM_REDIS_TLS_CERT_FILE": trusted.ClientCertFile, "IDEM_REDIS_TLS_KEY_FILE": trusted.ClientKeyFile})
	require.ErrorContains(t, err, "cache.example.com", "a server name the certificate lacks must be refused")
}

// TestRabbitTLS: through a TLS listener with a certificate of the test's
// CA in front of the local RabbitMQ, amqps:// with cacertfile naming that
// CA and a client certificate connects (through broker.Dial, as idem's
// consumers and relays do) and round-trips a message; with an unknown CA,
// or a host name the certificate lacks, it is refused. The listener is the
// test's (sandbox.TLSProxy), not the broker's: a RabbitMQ node of the
// test's own with listeners.ssl took 48 s to boot here, over a test's
// budget, and the shared broker may not be reconfigured. What the client
// checks (chain, name, its own certificate) is the same whoever
// terminates TLS.
func TestRabbitTLS(t *testing.T) {
	trusted, unknown := pkis(t)
	amqpURL := Default().AMQPURL
	if v := os.Getenv("AMQP_URL"); v != "" {
		amqpURL = v
	}
	u, err := amqp.ParseURI(amqpURL)
	require.NoError(t, err)
	proxy, err := sandbox.StartTLSProxy(trusted, net.JoinHostPort(u.Host, strconv.Itoa(u.Port)))
	require.NoError(t, err)
	t.Cleanup(proxy.Close)
	url := func(host, ca string) string {
		return fmt.Sprintf("amqps://%s:%s@%s:%d/%s?cacertfile=%s&certfile=%s&keyfile=%s", u.Username, u.Password,
			host, proxy.Port(), u.Vhost, ca, trusted.ClientCertFile, trusted.ClientKeyFile)
	}
	cfg := loaded()
	cfg.AMQPURL = url("localhost", trusted.CAFile)
	require.NoError(t, cfg.Validate())
	require.Empty(t, tlsWarningsOf(cfg, "amqp_url"))

	conn, _, err := broker.Dial(broker.SplitURLs(cfg.AMQPURL), 0, amqp.Config{})
	require.NoError(t, err, "amqps:// with the server's CA")
	t.Cleanup(func() { _ = conn.Close() })
	require.NotEmpty(t, conn.ConnectionState().PeerCertificates, "the connection is TLS")
	ch, err := conn.Channel()
	require.NoError(t, err)
	q, err := ch.QueueDeclare("", false, true, true, false, nil)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// sendAndGet publishes body on pub and gets it back on ch.
	sendAndGet := func(pub *amqp.Channel, body string) {
		t.Helper()
		require.NoError(t, pub.PublishWithContext(ctx, "", q.Name, false, false, amqp.Publishing{Body: []byte(body)}))
		deadline := time.Now().Add(10 * time.Second)
		for {
			m, ok, err := ch.Get(q.Name, true)
			require.NoError(t, err)
			if ok {
				require.Equal(t, body, string(m.Body))
				return
			}
			require.True(t, time.Now().Before(deadline), "the message never arrived")
			time.Sleep(20 * time.Millisecond)
		}
	}
	sendAndGet(ch, "over tls")

	_, _, err = broker.Dial([]string{url("localhost", unknown.CAFile)}, 0, amqp.Config{})
	require.ErrorContains(t, err, "certificate", "an unknown CA must be refused")
	_, _, err = broker.Dial([]string{url("localhost", trusted.CAFile) + "&server_name_indication=mq.example.com"}, 0, amqp.Config{})
	require.ErrorContains(t, err, "mq.example.com", "a name the certificate lacks must be refused")

	// A connection that reads frames above the broker's frame_max (every
	// consumer's consuming connection, the DLQ tools') speaks TLS too: its
	// frame reader sits above TLS, not under it (it read TLS records as
	// frames, and the handshake hung until its deadline).
	wide := amqp.Config{FrameSize: broker.ReadFrameMax}
	wconn, _, err := broker.Dial(broker.SplitURLs(cfg.AMQPURL), 0, wide)
	require.NoError(t, err, "amqps:// read wide")
	t.Cleanup(func() { _ = wconn.Close() })
	require.NotEmpty(t, wconn.ConnectionState().PeerCertificates, "the wide connection is TLS")
	wch, err := wconn.Channel()
	require.NoError(t, err)
	sendAndGet(wch, "wide over tls")
	_, _, err = broker.Dial([]string{url("localhost", unknown.CAFile)}, 0, wide)
	require.ErrorContains(t, err, "certificate", "an unknown CA must be refused on a wide connection too")
	_, _, err = broker.Dial([]string{url("localhost", trusted.CAFile) + "&server_name_indication=mq.example.com"}, 0, wide)
	require.ErrorContains(t, err, "mq.example.com", "a name the certificate lacks must be refused on a wide connection too")
}

// loaded is Default as Load completes it.
func loaded() Config {
	c := Default()
	c.Postgres.MaxConns = int32(c.Consumer.Workers + 4)
	return c
}

// tlsWarningsOf is c's TLS warnings about setting.
func tlsWarningsOf(c Config, setting string) []string {
	var out []string
	for _, w := range c.tlsWarnings() {
		if strings.HasPrefix(w, setting) {
			out = append(out, w)
		}
	}
	return out
}

// TestTLSWarnings: each link that is plaintext or does not verify the
// server, to a host off this machine, is warned about by its setting; the
// warning never quotes the URL; loopback links and verified TLS are not.
func TestTLSWarnings(t *testing.T) {
	const pw = "SecretPw99"
	cases := []struct {
		name string
		set  func(*Config)
		want string // "" : no warning
	}{
		{"defaults (loopback)", func(*Config) {}, ""},
		{"amqp plaintext", func(c *Config) { c.AMQPURL = "amqp://u:" + pw + "@mq.example.com:5672/" }, "amqp_url: amqp:// is plaintext"},
		{"amqp second node plaintext", func(c *Config) {
			c.AMQPURL = "amqps://u:" + pw + "@mq1.example.com/,amqp://u:" + pw + "@mq2.example.com/"
		}, "amqp_url: amqp:// is plaintext"},
		{"amqps", func(c *Config) { c.AMQPURL = "amqps://u:" + pw + "@mq.example.com/" }, ""},
		{"redis plaintext", func(c *Config) { c.RedisURL = "redis://u:" + pw + "@cache.example.com:6379/0" }, "redis_url: redis:// is plaintext"},
		{"rediss skip_verify", func(c *Config) { c.RedisURL = "rediss://u:" + pw + "@cache.example.com:6379/0?skip_verify=true" }, "redis_url: TLS without certificate checks"},
		{"rediss skip_verify on loopback", func(c *Config) { c.RedisURL = "rediss://127.0.0.1:6379/0?skip_verify=true" }, "redis_url: TLS without certificate checks"},
		{"rediss", func(c *Config) { c.RedisURL = "rediss://u:" + pw + "@cache.example.com:6379/0" }, ""},
		{"redis cluster plaintext", func(c *Config) {
			c.Redis.Mode, c.RedisURL = "cluster", "redis://127.0.0.1:7001?addr=r2.example.com:7001"
		}, "redis_url: redis:// is plaintext"},
		{"redis off", func(c *Config) { c.Redis.Enabled, c.RedisURL = false, "redis://cache.example.com:6379/0" }, ""},
		{"sslmode unset", func(c *Config) { c.DatabaseURL = "postgres://u:" + pw + "@db.example.com/app" }, "database_url: sslmode=prefer"},
		{"sslmode disable", func(c *Config) { c.DatabaseURL = "postgres://u:" + pw + "@db.example.com/app?sslmode=disable" }, "database_url: sslmode=disable"},
		{"sslmode allow", func(c *Config) { c.DatabaseURL = "postgres://u:" + pw + "@db.example.com/app?sslmode=allow" }, "database_url: sslmode=allow"},
		{"sslmode require", func(c *Config) { c.DatabaseURL = "postgres://u:" + pw + "@db.example.com/app?sslmode=require" }, "database_url: sslmode=require"},
		{"sslmode verify-ca", func(c *Config) { c.DatabaseURL = "host=db.example.com password=" + pw + " sslmode=verify-ca" }, "database_url: sslmode=verify-ca"},
		{"sslmode verify-full", func(c *Config) { c.DatabaseURL = "postgres://u:" + pw + "@db.example.com/app?sslmode=verify-full" }, ""},
		{"unix socket", func(c *Config) { c.DatabaseURL = "host=/var/run/postgresql sslmode=disable" }, ""},
		{"redis unix socket", func(c *Config) { c.RedisURL = "unix:///var/run/redis/redis.sock" }, ""},
		{"shard below verify-full", func(c *Config) {
			c.Postgres.Shards = "postgres://db0.example.com/a?sslmode=verify-full postgres://u:" + pw + "@db1.example.com/a?sslmode=require"
		}, "postgres.shards (shard 1): sslmode=require"},
		{"http destination", func(c *Config) { c.Outbox.Destinations = "api=http://u:" + pw + "@api.example.com/hook" }, "outbox.destinations (api): http:// is plaintext"},
		{"https destination", func(c *Config) { c.Outbox.Destinations = "api=https://api.example.com/hook" }, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := loaded()
			tc.set(&c)
			require.NoError(t, c.Validate())
			w := c.tlsWarnings()
			if tc.want == "" {
				require.Empty(t, w)
				return
			}
			require.Len(t, w, 1, "%q", w)
			require.Contains(t, w[0], tc.want)
			require.NotContains(t, w[0], pw)
			require.NotContains(t, w[0], "example.com")
			require.Contains(t, c.Warnings(), w[0], "Warnings (idem config, start-up) includes it")
		})
	}
}

// TestRedisTLSSettings: redis.tls_* need rediss://; in cluster and sentinel
// mode the server name is left to crypto/tls, which takes each node's own
// host as it dials it (go-redis's parser pins the first host's); a set
// tls_server_name wins.
func TestRedisTLSSettings(t *testing.T) {
	trusted, _ := pkis(t)
	_, err := load(t, "", map[string]string{"REDIS_URL": "redis://127.0.0.1:6379/0", "IDEM_REDIS_TLS_CA_FILE": trusted.CAFile})
	require.ErrorContains(t, err, "redis.tls_ca_file: is set but redis_url is redis://")
	_, err = load(t, "", map[string]string{"REDIS_URL": "rediss://127.0.0.1:6379/0", "IDEM_REDIS_TLS_CA_FILE": trusted.ClientKeyFile})
	require.ErrorContains(t, err, "redis.tls_ca_file")
	_, err = load(t, "", map[string]string{"REDIS_URL": "rediss://127.0.0.1:6379/0", "IDEM_REDIS_TLS_CERT_FILE": trusted.ClientCertFile})
	require.ErrorContains(t, err, "redis.tls_key_file together")

	for _, tc := range []struct{ mode, url, serverName, want string }{
		{"single", "rediss://r1.example.com:7001/0", "", "r1.example.com"},
		{"cluster", "rediss://r1.example.com:7001?addr=r2.example.com:7001", "", ""},
		{"sentinel", "rediss://s1.example.com:26379?addr=s2.example.com:26379&master_name=m", "", ""},
		{"cluster", "rediss://r1.example.com:7001?addr=r2.example.com:7001", "redis.internal", "redis.internal"},
	} {
		cfg, err := load(t, "", map[string]string{"REDIS_URL": tc.url, "IDEM_REDIS_MODE": tc.mode,
			"IDEM_REDIS_TLS_CA_FILE": trusted.CAFile, "IDEM_REDIS_TLS_SERVER_NAME": tc.serverName})
		require.NoError(t, err)
		rdb, err := cfg.RedisClient()
		require.NoError(t, err)
		var got string
		switch c := rdb.(type) {
		case *redis.Client:
			got = c.Options().TLSConfig.ServerName
			require.NotNil(t, c.Options().TLSConfig.RootCAs)
		case *redis.ClusterClient:
			got = c.Options().TLSConfig.ServerName
			require.NotNil(t, c.Options().TLSConfig.RootCAs)
		}
		require.Equal(t, tc.want, got, "%s %s", tc.mode, tc.url)
		require.NoError(t, rdb.Close())
	}
}

// TestRedisClusterTLSVerifiesEachNodeByItsOwnAddress: a Redis Cluster node
// with TLS whose certificate names 127.0.0.1 only, reached through a URL
// whose first host is localhost (a name the certificate lacks) and whose
// second is 127.0.0.1. go-redis's parser pins every node to the first
// host's name, so its client can reach no node; idem's leaves the name to
// crypto/tls, which checks each node against the address it dials, and
// reaches the cluster through the second seed and the nodes it announces.
func TestRedisClusterTLSVerifiesEachNodeByItsOwnAddress(t *testing.T) {
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Skip("redis-server not installed")
	}
	p, err := sandbox.NewPKI(t.TempDir(), "127.0.0.1")
	require.NoError(t, err)
	node, tlsPort, err := sandbox.StartRedisClusterTLS(t.TempDir(), p)
	require.NoError(t, err)
	t.Cleanup(node.Kill)
	url := fmt.Sprintf("rediss://localhost:%d?addr=127.0.0.1:%d", tlsPort, tlsPort)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()

	cfg, err := load(t, "", map[string]string{"REDIS_URL": url, "IDEM_REDIS_MODE": "cluster", "IDEM_REDIS_TLS_CA_FILE": p.CAFile})
	require.NoError(t, err)
	rdb, err := cfg.RedisClient()
	require.NoError(t, err)
	defer rdb.Close()
	require.NoError(t, rdb.Set(ctx, "idem-tls-test", "1", time.Minute).Err(), "idem's cluster client, each node by its own address")

	pinned, err := redis.ParseClusterURL(url)
	require.NoError(t, err)
	require.Equal(t, "localhost", pinned.TLSConfig.ServerName, "go-redis pins the first host's name")
	pinned.TLSConfig.RootCAs = cfg.mustRedisTLS(t).RootCAs
	pinned.MaxRetries = -1
	stock := redis.NewClusterClient(pinned)
	defer stock.Close()
	require.ErrorContains(t, stock.Set(ctx, "idem-tls-test", "1", time.Minute).Err(), "localhost",
		"the pinned name fails on a node whose certificate names its address")
}

// mustRedisTLS is c's Redis TLS configuration.
func (c Config) mustRedisTLS(t *testing.T) *tls.Config {
	o, err := parseRedisURL(c.Redis.Mode, c.RedisURL)
	require.NoError(t, err)
	tc, err := c.redisTLS(urlTLS(o))
	require.NoError(t, err)
	return tc
}
