package relay

import (
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/redact"
)

// Kind is how a destination is reached.
type Kind int

const (
	// Queue: an idem stream's quorum queue(s) through the default exchange,
	// the partition chosen by the message's key as idem publish does.
	Queue Kind = iota + 1
	// Exchange: any exchange, with a fixed routing key or the message's key.
	Exchange
	// HTTP: a POST with the message ID as its Idempotency-Key header.
	HTTP
)

// Destination is where the messages enqueued To one name go.
type Destination struct {
	Name string
	Kind Kind
	// Stream is the queue destination's topology (Queue, Partitions).
	Stream broker.Topology
	// Exchange and RoutingKey address an exchange destination; an empty
	// RoutingKey routes by the message's key.
	Exchange, RoutingKey string
	// URL is the HTTP destination's endpoint.
	URL string
	// Header is added to each of the HTTP destination's requests (a
	// bearer token, an API key). Its values are secrets: never logged,
	// stored or quoted in an error.
	Header http.Header
	// Request, if set, is called on each HTTP request just before it is
	// sent, after idem's headers are set (to sign it, say), bounded by the
	// request's context. An error, or no answer within PublishTimeout,
	// holds the row back without spending an attempt (it was never sent)
	// and is reported by Ready.
	Request func(*http.Request) error
	// Final lists the HTTP statuses that are final for this destination:
	// a row answered so goes dead at once. nil: DefaultFinal. Any other
	// failing status is tried again later, and counts towards a pause
	// (PauseRows).
	Final []int
}

// DefaultFinal reports whether an HTTP status is final by default: a 3xx
// or 4xx but 401 and 403 (a rotated or wrong credential, rarely the row's
// fault: they pause the destination instead), 408, 425 and 429.
func DefaultFinal(code int) bool {
	switch code {
	case http.StatusUnauthorized, http.StatusForbidden, http.StatusRequestTimeout, http.StatusTooEarly, http.StatusTooManyRequests:
		return false
	}
	return code >= 300 && code < 500
}

// final reports whether the destination's answer code is final.
func (d Destination) final(code int) bool {
	if d.Final == nil {
		return DefaultFinal(code)
	}
	return slices.Contains(d.Final, code)
}

// ParseStatuses reads a list of HTTP statuses and ranges (400-499),
// separated by commas, each 300 to 599.
func ParseStatuses(s string) ([]int, error) {
	out := []int{}
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		lo, hi, isRange := strings.Cut(f, "-")
		a, err1 := strconv.Atoi(lo)
		b, err2 := a, error(nil)
		if isRange {
			b, err2 = strconv.Atoi(hi)
		}
		if err1 != nil || err2 != nil || a < 300 || b > 599 || a > b {
			return nil, fmt.Errorf("%q: want a status or a range of them, 300 to 599", f)
		}
		for c := a; c <= b; c++ {
			if !slices.Contains(out, c) {
				out = append(out, c)
			}
		}
	}
	slices.Sort(out)
	return out, nil
}

// String describes d for logs and errors; an HTTP destination's URL has its
// credentials masked (redact.URL).
func (d Destination) String() string {
	switch d.Kind {
	case Queue:
		return fmt.Sprintf("queue:%s/%d", d.Stream.Queue, max(d.Stream.Partitions, 1))
	case Exchange:
		return fmt.Sprintf("exchange:%s/%s", d.Exchange, d.RoutingKey)
	}
	return redact.URL(d.URL)
}

// route returns the exchange and routing key of an AMQP message with key.
func (d Destination) route(key string) (exchange, routingKey string) {
	if d.Kind == Queue {
		return "", d.Stream.QueueFor(key)
	}
	if d.RoutingKey == "" {
		return d.Exchange, key
	}
	return d.Exchange, d.RoutingKey
}

// ParseDestinations reads outbox.destinations: name=target pairs separated
// by spaces or newlines, where target is one of
//
//	queue:<queue>[/<partitions>]        an idem stream (partitions as the stream's partitions setting)
//	exchange:<exchange>[/<routing key>] any exchange; no routing key routes by the message's key
//	http://… or https://…               POST to that URL
func ParseDestinations(s string) (map[string]Destination, error) {
	out := map[string]Destination{}
	for _, f := range strings.Fields(s) {
		name, target, ok := strings.Cut(f, "=")
		if !ok || name == "" || target == "" {
			return nil, fmt.Errorf("%q: want name=target", f)
		}
		if _, dup := out[name]; dup {
			return nil, fmt.Errorf("%q: destination named twice", name)
		}
		d, err := parseTarget(target)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		d.Name = name
		out[name] = d
	}
	return out, nil
}

func parseTarget(t string) (Destination, error) {
	kind, rest, _ := strings.Cut(t, ":")
	switch kind {
	case "queue":
		q, parts, _ := strings.Cut(rest, "/")
		if q == "" {
			return Destination{}, fmt.Errorf("%q: want queue:<queue>[/<partitions>]", t)
		}
		d := Destination{Kind: Queue, Stream: broker.TopologyFor(q, 0)}
		if parts != "" {
			n, err := strconv.Atoi(parts)
			if err != nil || n < 1 || n > 1024 {
				return Destination{}, fmt.Errorf("%q: partitions must be 1 to 1024", t)
			}
			d.Stream.Partitions = n
		}
		return d, nil
	case "exchange":
		x, key, _ := strings.Cut(rest, "/")
		if x == "" {
			return Destination{}, fmt.Errorf("%q: want exchange:<exchange>[/<routing key>] (the default exchange is queue:)", t)
		}
		return Destination{Kind: Exchange, Exchange: x, RoutingKey: key}, nil
	case "http", "https":
		u, err := url.Parse(t)
		if err != nil || u.Host == "" {
			return Destination{}, fmt.Errorf("%q: not an absolute URL", redact.URL(t))
		}
		return Destination{Kind: HTTP, URL: t}, nil
	}
	return Destination{}, fmt.Errorf("%q: want queue:…, exchange:… or an http(s) URL", redact.String(t))
}

// Names returns the destinations' names, sorted.
func Names(ds map[string]Destination) []string {
	out := make([]string, 0, len(ds))
	for n := range ds {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}
