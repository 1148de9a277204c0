package broker

import (
	"errors"
	"fmt"
	"strings"

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
func Dial(urls []string, start int, cfg amqp.Config) (*amqp.Connection, int, error) {
	if len(urls) == 0 {
		return nil, 0, errors.New("no AMQP URL")
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
