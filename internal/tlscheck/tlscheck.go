// Package tlscheck finds the links whose traffic could be read or changed on
// the way: plaintext, or TLS that does not verify the server. Its warnings
// name the setting and never quote a URL, which may hold a password. A
// plaintext or unverified link to a loopback address or a Unix socket is
// not warned about: its traffic never leaves the host (a local
// TLS-terminating proxy, such as Cloud SQL Auth Proxy or stunnel, is the
// legitimate case). Turning verification off (skip_verify) is, anywhere.
package tlscheck

import (
	"crypto/tls"
	"fmt"
	"net"
	"net/url"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/internal/broker"
)

// Loopback reports whether host (a name, an IP address, or a Unix socket's
// path) never leaves this machine.
func Loopback(host string) bool {
	if strings.HasPrefix(host, "/") || strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(strings.Trim(host, "[]"))
	return ip != nil && ip.IsLoopback()
}

// PostgresMode is the sslmode c was parsed with, read from the TLS configs
// pgx built for it (so that PGSSLMODE and require-with-sslrootcert count):
// disable, allow, prefer, require, verify-ca or verify-full.
func PostgresMode(c *pgconn.Config) string {
	first := c.TLSConfig
	plainFallback, tlsFallback := false, false
	for _, f := range c.Fallbacks {
		if f.TLSConfig == nil {
			plainFallback = true
		} else {
			tlsFallback = true
		}
	}
	switch {
	case first == nil && tlsFallback:
		return "allow"
	case first == nil:
		return "disable"
	case plainFallback:
		return "prefer"
	case !first.InsecureSkipVerify:
		return "verify-full"
	case first.VerifyPeerCertificate != nil:
		return "verify-ca"
	}
	return "require"
}

// Postgres returns a warning for a PostgreSQL connection below
// sslmode=verify-full to a host off this machine, or "".
func Postgres(setting string, c *pgconn.Config) string {
	if local(c) {
		return ""
	}
	switch mode := PostgresMode(c); mode {
	case "disable":
		return setting + ": sslmode=disable is plaintext; use sslmode=verify-full"
	case "allow", "prefer":
		return fmt.Sprintf("%s: sslmode=%s (the default when unset) does not verify the server and can fall back to plaintext; use sslmode=verify-full", setting, mode)
	case "require", "verify-ca":
		what := "does not verify the server"
		if mode == "verify-ca" {
			what = "does not check the server's name"
		}
		return fmt.Sprintf("%s: sslmode=%s %s; use sslmode=verify-full", setting, mode, what)
	}
	return ""
}

// local reports whether every host c may connect to is on this machine.
func local(c *pgconn.Config) bool {
	if !Loopback(c.Host) {
		return false
	}
	for _, f := range c.Fallbacks {
		if !Loopback(f.Host) {
			return false
		}
	}
	return true
}

// AMQP returns a warning, once, if any of the comma-separated node URLs
// is amqp:// to a host off this machine, or "". A URL that does not parse
// is Validate's to refuse.
func AMQP(setting, urls string) string {
	for _, raw := range broker.SplitURLs(urls) {
		u, err := amqp.ParseURI(raw)
		if err == nil && u.Scheme != "amqps" && !Loopback(u.Host) {
			return setting + ": amqp:// is plaintext; use amqps://"
		}
	}
	return ""
}

// Redis returns a warning for a client with no TLS to a host off this
// machine, or with TLS that skips verification (skip_verify=true), or "".
// addrs are the addresses it was given (host:port).
func Redis(setting string, cfg *tls.Config, addrs ...string) string {
	if cfg != nil {
		if cfg.InsecureSkipVerify && cfg.VerifyPeerCertificate == nil {
			return setting + ": TLS without certificate checks (skip_verify=true); remove it and trust the server's CA instead"
		}
		return ""
	}
	for _, a := range addrs {
		if Loopback(a) { // a Unix socket's path (unix://)
			continue
		}
		host, _, err := net.SplitHostPort(a)
		if err != nil || !Loopback(host) {
			return setting + ": redis:// is plaintext; use rediss://"
		}
	}
	return ""
}

// RedisClient is Redis for a client the caller built: a *redis.Client or a
// *redis.ClusterClient (a Sentinel-backed client's master address is not
// known before it connects, so it counts as off this machine).
func RedisClient(setting string, rdb redis.UniversalClient) string {
	switch c := rdb.(type) {
	case *redis.Client:
		return Redis(setting, c.Options().TLSConfig, c.Options().Addr)
	case *redis.ClusterClient:
		return Redis(setting, c.Options().TLSConfig, c.Options().Addrs...)
	}
	return ""
}

// HTTP returns a warning for an http:// endpoint off this machine, or "".
// setting should name the destination, not quote its URL.
func HTTP(setting, rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil || u.Scheme != "http" || Loopback(u.Hostname()) {
		return ""
	}
	return setting + ": http:// is plaintext; use https://"
}
