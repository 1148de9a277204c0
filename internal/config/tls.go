package config

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/tlscheck"
)

// redisTLS returns the TLS configuration of a client whose redis_url
// go-redis parsed into urlTLS (nil for redis://), with redis.tls_* applied;
// nil for plaintext. In cluster and sentinel mode go-redis pins every
// node to the first host's name: the name is cleared, so that crypto/tls
// verifies each node against the address it dials.
func (c Config) redisTLS(urlTLS *tls.Config) (*tls.Config, error) {
	r := c.Redis
	if urlTLS == nil {
		for field, v := range map[string]string{"redis.tls_ca_file": r.TLSCAFile, "redis.tls_cert_file": r.TLSCertFile,
			"redis.tls_key_file": r.TLSKeyFile, "redis.tls_server_name": r.TLSServerName} {
			if v != "" {
				return nil, bad(field, "is set but redis_url is redis:// (plaintext); use rediss://")
			}
		}
		return nil, nil
	}
	t := urlTLS.Clone()
	t.MinVersion = max(t.MinVersion, tls.VersionTLS12)
	if c.Redis.Mode != "single" {
		t.ServerName = ""
	}
	if r.TLSServerName != "" {
		t.ServerName = r.TLSServerName
	}
	if r.TLSCAFile != "" {
		pem, err := os.ReadFile(r.TLSCAFile)
		if err != nil {
			return nil, bad("redis.tls_ca_file", "%v", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, bad("redis.tls_ca_file", "%s holds no PEM certificate", r.TLSCAFile)
		}
		t.RootCAs = pool
	}
	if (r.TLSCertFile == "") != (r.TLSKeyFile == "") {
		return nil, bad("redis.tls_cert_file", "set it and redis.tls_key_file together, or neither")
	}
	if r.TLSCertFile != "" {
		cert, err := tls.LoadX509KeyPair(r.TLSCertFile, r.TLSKeyFile)
		if err != nil {
			return nil, bad("redis.tls_cert_file", "with redis.tls_key_file: %v", err)
		}
		t.Certificates = []tls.Certificate{cert}
	}
	return t, nil
}

// validateRedisTLS checks redis.tls_* against redis_url (already parsed).
func (c Config) validateRedisTLS() error {
	if !c.Redis.Enabled {
		return nil
	}
	o, err := parseRedisURL(c.Redis.Mode, c.RedisURL)
	if err != nil {
		return nil // validateConnections reports it
	}
	_, err = c.redisTLS(urlTLS(o))
	return err
}

// urlTLS is the TLS configuration go-redis parsed from the URL, with the
// addresses the client is given.
func urlTLS(o any) *tls.Config {
	switch o := o.(type) {
	case *redis.Options:
		return o.TLSConfig
	case *redis.ClusterOptions:
		return o.TLSConfig
	case *redis.FailoverOptions:
		return o.TLSConfig
	}
	return nil
}

// tlsWarnings lists the links that are plaintext or do not verify the
// server (tlscheck says which; loopback hosts are exempt). Each names the
// setting, never the URL.
func (c Config) tlsWarnings() []string {
	var w []string
	add := func(s string) {
		if s != "" {
			w = append(w, s)
		}
	}
	add(tlscheck.AMQP("amqp_url", c.AMQPURL))
	if c.Redis.Enabled {
		if o, err := parseRedisURL(c.Redis.Mode, c.RedisURL); err == nil {
			t, _ := c.redisTLS(urlTLS(o)) // validated
			switch o := o.(type) {
			case *redis.Options:
				add(tlscheck.Redis("redis_url", t, o.Addr))
			case *redis.ClusterOptions:
				add(tlscheck.Redis("redis_url", t, o.Addrs...))
			case *redis.FailoverOptions:
				add(tlscheck.Redis("redis_url", t, o.SentinelAddrs...))
			}
		}
	}
	if shards := strings.Fields(c.Postgres.Shards); len(shards) > 0 {
		for i, u := range shards {
			if pc, err := pgconn.ParseConfig(u); err == nil {
				add(tlscheck.Postgres(fmt.Sprintf("postgres.shards (shard %d)", i), pc))
			}
		}
	} else if pc, err := pgconn.ParseConfig(c.DatabaseURL); err == nil {
		add(tlscheck.Postgres("database_url", pc))
	}
	dests, _ := relay.ParseDestinations(c.Outbox.Destinations)
	for _, name := range relay.Names(dests) {
		if d := dests[name]; d.Kind == relay.HTTP {
			add(tlscheck.HTTP(fmt.Sprintf("outbox.destinations (%s)", name), d.URL))
		}
	}
	return w
}
