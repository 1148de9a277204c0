package broker

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// SplitURLs splits a comma-separated list of AMQP URLs (the nodes of a
// RabbitMQ cluster) into its URLs, trimmed, empty ones dropped.
func SplitURLs(s string) []string {
	var out []string
	for u := range strings.SplitSeq(s, ",") {
		if u = strings.TrimSpace(u); u != "" {
			out = append(out, u)
		}
	}
	return out
}

// Dial connects to one of urls: urls[start % len(urls)] first, then the
// others in turn. It returns the connection and the index of the URL that
// took it. If none does, the error joins each URL's error, so that
// errors.Is and errors.As see why each failed.
//
// Every connection has a bound on how long a silent peer can hold it: a
// heartbeat (DefaultHeartbeat unless cfg sets one) and WriteTimeout on
// every write.
func Dial(urls []string, start int, cfg amqp.Config) (*amqp.Connection, int, error) {
	if len(urls) == 0 {
		return nil, 0, errors.New("no AMQP URL")
	}
	if cfg.Heartbeat == 0 {
		cfg.Heartbeat = DefaultHeartbeat
	}
	if cfg.Dial == nil {
		dial := amqp.DefaultDial(dialTimeout)
		cfg.Dial = func(network, addr string) (net.Conn, error) {
			c, err := dial(network, addr)
			if err != nil {
				return nil, err
			}
			return &writeBounded{Conn: c}, nil
		}
	}
	var errs []error
	for k := range urls {
		i := (start + k) % len(urls)
		conn, err := amqp.DialConfig(urls[i], cfg)
		if err == nil {
			return conn, i, nil
		}
		if len(urls) > 1 {
			err = fmt.Errorf("node %d of %d: %w", i+1, len(urls), err)
		}
		errs = append(errs, err)
	}
	return nil, 0, errors.Join(errs...)
}

// PublishingConnectionSuffix ends the name of a consumer's publishing
// connection: consumer.Config.ConnectionName + PublishingConnectionSuffix.
const PublishingConnectionSuffix = "-publish"

// DefaultHeartbeat is the heartbeat Dial asks for: a peer silent for two of
// them ends the connection.
const DefaultHeartbeat = 10 * time.Second

// dialTimeout bounds the TCP connect and the AMQP handshake.
const dialTimeout = 30 * time.Second

// writeBounded sets a write deadline of WriteTimeout before every write.
type writeBounded struct{ net.Conn }

func (c *writeBounded) Write(b []byte) (int, error) {
	if err := c.Conn.SetWriteDeadline(time.Now().Add(WriteTimeout)); err != nil {
		return 0, err
	}
	return c.Conn.Write(b)
}
