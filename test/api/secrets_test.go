package api

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/idem"
	"github.com/idemhq/idem/pkg/outbox"
)

// secret is the password every malformed setting below carries.
const secret = "SecretPw99"

// TestNoSecretInTheLibrarysErrors: every setting of pkg/... that takes a
// URL or DSN, given a malformed one holding a password, is refused by an
// error that names the setting and does not hold the password, in any of
// the spellings a parser might quote it in. The binary redacts what it
// prints; a service that imports the library logs these errors as they are.
func TestNoSecretInTheLibrarysErrors(t *testing.T) {
	const (
		db   = "postgres://postgres@127.0.0.1:5432/test"
		amqp = "amqp://guest:guest@127.0.0.1:5672/"
	)
	// Malformed in the ways a URL parser quotes a piece of: a bad port, a
	// bad %-escape, an unknown keyword, a bad value.
	badDSNs := map[string]string{
		"bad port":         "postgres://u:" + secret + "@db:bad/test",
		"bad escape":       "postgres://u:" + secret + "%zz@db:5432/test",
		"port in userinfo": "postgres://u:" + secret + "/x@db:5432/test",
		"keyword DSN":      "host=db user=u password=" + secret + " sslmode=bogus",
		"quoted keyword":   "host=db user=u password='" + secret + " x' port=bad",
		"bad param":        "postgres://u:" + secret + "@db:5432/test?sslmode=bogus",
	}
	badRedis := map[string]string{
		"bad port":   "redis://u:" + secret + "@cache:bad/0",
		"bad escape": "redis://u:" + secret + "%zz@cache:6379/0",
		"bad db":     "redis://u:" + secret + "@cache:6379/x",
		"bad scheme": "rediss//u:" + secret + "@cache:6379/0",
	}
	badAMQP := map[string]string{
		"bad port":          "amqp://u:" + secret + "@mq:bad/",
		"bad escape":        "amqp://u:" + secret + "%zz@mq:5672/",
		"bad scheme":        "amqps//u:" + secret + "@mq:5672/",
		"second node":       amqp + ",amqp://u:" + secret + "@mq2:bad/",
		"slash in password": "amqp://u:" + secret + "/x@mq:5672/",
	}
	badHTTP := map[string]string{
		"bad port":   "https://u:" + secret + "@api.example.com:bad/hook",
		"bad escape": "https://u:" + secret + "%zz@api.example.com/hook",
		"not http":   "ftp://u:" + secret + "@api.example.com/hook",
		"token":      "https://api.example.com:bad/hook?access_token=" + secret,
	}
	base := func() idem.Config {
		return idem.Config{Scope: "svc", DatabaseURL: db,
			Consumer: consumer.Config{URL: amqp, Queue: "svc.events"}}
	}
	type setting struct {
		name string
		bad  map[string]string
		new  func(string) error
	}
	settings := []setting{
		{"idem.Config.DatabaseURL", badDSNs, func(u string) error {
			c := base()
			c.DatabaseURL = u
			return newService(c)
		}},
		{"idem.Config.RedisURL", badRedis, func(u string) error {
			c := base()
			c.RedisURL = u
			return newService(c)
		}},
		{"idem.Config.Consumer.URL", badAMQP, func(u string) error {
			c := base()
			c.Consumer.URL = u
			return newService(c)
		}},
		{"idem.Config.Outbox.AMQPURL", badAMQP, func(u string) error {
			c := base()
			c.Outbox = outbox.RelayConfig{AMQPURL: u, Destinations: map[string]outbox.Destination{"q": {Queue: "q"}}}
			return newService(c)
		}},
		{"idem.Config.Outbox.Destinations[].URL", badHTTP, func(u string) error {
			c := base()
			c.Outbox = outbox.RelayConfig{Destinations: map[string]outbox.Destination{"api": {URL: u}}}
			return newService(c)
		}},
		{"consumer.Config.URL", badAMQP, func(u string) error {
			_, err := consumer.New[string](consumer.Config{URL: u, Queue: "q"}, nil, nopHandler{})
			return err
		}},
		{"outbox.RelayConfig.AMQPURL", badAMQP, func(u string) error {
			_, err := outbox.NewRelay(outbox.RelayConfig{AMQPURL: u,
				Destinations: map[string]outbox.Destination{"q": {Queue: "q"}}})
			return err
		}},
		{"outbox.RelayConfig.Destinations[].URL", badHTTP, func(u string) error {
			_, err := outbox.NewRelay(outbox.RelayConfig{AMQPURL: amqp,
				Destinations: map[string]outbox.Destination{"api": {URL: u}}})
			return err
		}},
	}
	for _, s := range settings {
		for name, u := range s.bad {
			t.Run(s.name+"/"+name, func(t *testing.T) {
				err := s.new(u)
				if err == nil {
					t.Fatalf("%q was accepted", u)
				}
				for e := err; e != nil; e = errors.Unwrap(e) {
					if msg := e.Error(); strings.Contains(msg, secret) || strings.Contains(msg, secret[:6]) {
						t.Errorf("the error holds the password: %s", msg)
					}
				}
			})
		}
	}
}

// newService is idem.New's error.
func newService(c idem.Config) error {
	_, err := idem.New[string](c, nopHandler{})
	return err
}

type nopHandler struct{}

func (nopHandler) Decode(consumer.Message) (guard.Event, string, error) {
	return guard.Event{}, "", errors.New("nop")
}

func (nopHandler) Apply(context.Context, pgx.Tx, string) error { return nil }
