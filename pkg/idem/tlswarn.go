package idem

import (
	"fmt"
	"slices"

	"github.com/idemhq/idem/internal/tlscheck"
)

// warnLinks logs, once, each link that is plaintext or does not verify the
// server (docs/operations.md, TLS): an amqp:// or redis:// URL, an sslmode
// below verify-full, skip_verify, an http:// outbox destination. Links to a
// loopback address or a Unix socket are not warned about.
func (s *Service[T]) warnLinks() {
	var w []string
	add := func(msg string) {
		if msg != "" {
			w = append(w, msg)
		}
	}
	for i, p := range s.dbs {
		setting := "DatabaseURL"
		if !s.ownDBs {
			setting = fmt.Sprintf("Databases[%d]", i)
		}
		add(tlscheck.Postgres(setting, &p.Config().ConnConfig.Config))
	}
	add(tlscheck.AMQP("Consumer.URL", s.cfg.Consumer.URL))
	if s.relay != nil && s.cfg.Outbox.AMQPURL != "" && s.cfg.Outbox.AMQPURL != s.cfg.Consumer.URL {
		add(tlscheck.AMQP("Outbox.AMQPURL", s.cfg.Outbox.AMQPURL))
	}
	if s.rdb != nil {
		setting := "Redis"
		if s.ownRDB {
			setting = "RedisURL"
		}
		add(tlscheck.RedisClient(setting, s.rdb))
	}
	names := make([]string, 0, len(s.cfg.Outbox.Destinations))
	for name := range s.cfg.Outbox.Destinations {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		if u := s.cfg.Outbox.Destinations[name].URL; u != "" {
			add(tlscheck.HTTP(fmt.Sprintf("Outbox.Destinations[%q]", name), u))
		}
	}
	for _, msg := range w {
		s.log.Warn("idem: insecure link: " + msg)
	}
}
