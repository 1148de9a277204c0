package outbox

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strings"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/redact"
	"github.com/idemhq/idem/internal/relay"
)

// Destination is where the messages enqueued To one name go: exactly one
// of Queue, Exchange or URL.
type Destination struct {
	// Queue is an idem stream's queue: each message is published to it
	// through the default exchange (to the partition of its Key, with
	// Partitions), persistent, mandatory, confirmed, with its ID as the
	// AMQP message ID.
	Queue string
	// Partitions is the Queue stream's partition count, as its consumers'
	// consumer.Config.Partitions; 0 or 1: one queue, named Queue. A relay
	// refuses to start when a database records another count for the
	// stream: it would send a key's messages to another queue than the
	// stream's publishers do.
	Partitions int
	// Exchange is any exchange; RoutingKey, if set, routes every message,
	// and otherwise each routes by its Key.
	Exchange, RoutingKey string
	// URL is an http or https endpoint: each message is POSTed to it with
	// its ID as the Idempotency-Key header. Basic auth in the URL
	// (https://user:password@host/…, or https://<token>@host/…) works;
	// its password or token, and query parameters that name a credential
	// (?access_token=…), are masked in every log line and stored error,
	// quoted in an answer's body included.
	URL string
	// Header is added to each request to URL (an Authorization bearer
	// token, an API key). It may not name a header idem sets
	// (Content-Type, Idempotency-Key, any X-Idem-…) or net/http does
	// (Host, Content-Length, Transfer-Encoding, Trailer, Connection). Its
	// values are never logged, and are masked wherever an answer or an
	// error quotes them, but for one under 4 bytes: too short to be a
	// credential, and masking it would garble ordinary words.
	Header http.Header
	// Request, if set, is called on each request to URL just before it is
	// sent, with every header set (to sign it, or to set a token it
	// fetches); the values it adds or changes are masked as Header's are.
	// It must return once req.Context() ends: the relay waits for it at
	// most PublishTimeout, and never past the pass's end or Run's, then
	// leaves it running and the request unsent. Its error, or its not
	// returning, is no answer of the destination's and spends no attempt:
	// the message stays pending, and the relay logs the error (masked as
	// above, so it should hold no other secret), backs off as from a
	// broker outage, and says so in Ready.
	Request func(*http.Request) error
	// FinalStatuses lists the HTTP answers that make a row dead at once
	// (the row's own fault: it will never pass), each 300 to 599. nil: a
	// 3xx or 4xx but 401, 403, 408, 425 and 429; an empty, non-nil list:
	// none. Any other failing answer, and no answer, is tried again, and
	// when distinct rows keep failing alike (5 in a row, in
	// one class: one status, or any 5xx) the destination pauses: its rows
	// stay pending and spend no attempt, the relay is not ready and says
	// why, and one row probes on the backoff until one is answered.
	FinalStatuses []int
}

// relayed checks d, named name, and returns it as the relay takes it.
// Its errors name the destination and the field, and quote a URL with its
// credentials masked and no header's value.
func (d Destination) relayed(name string) (relay.Destination, error) {
	fail := func(format string, args ...any) error {
		return fmt.Errorf("outbox: destination %q: %s", name, fmt.Sprintf(format, args...))
	}
	if err := checkField(name, 0, false); err != nil || name == "" {
		return relay.Destination{}, fmt.Errorf("outbox: destination %q: the name must be non-empty valid UTF-8 without NUL (it is stored as Message.To)", name)
	}
	set := 0
	for _, v := range []string{d.Queue, d.Exchange, d.URL} {
		if v != "" {
			set++
		}
	}
	switch {
	case set != 1:
		return relay.Destination{}, fail("set exactly one of Queue, Exchange and URL")
	case d.Queue == "" && d.Partitions != 0:
		return relay.Destination{}, fail("Partitions is for a Queue destination")
	case d.Exchange == "" && d.RoutingKey != "":
		return relay.Destination{}, fail("RoutingKey is for an Exchange destination")
	case d.URL == "" && (d.Header != nil || d.Request != nil || d.FinalStatuses != nil):
		return relay.Destination{}, fail("Header, Request and FinalStatuses are for a URL destination")
	}
	for _, c := range d.FinalStatuses {
		if c < 300 || c > 599 {
			return relay.Destination{}, fail("FinalStatuses: %d: want 300 to 599 (a 2xx is sent)", c)
		}
	}
	out := relay.Destination{Name: name}
	switch {
	case d.Queue != "":
		if err := checkField(d.Queue, maxShortstr, false); err != nil {
			return relay.Destination{}, fail("Queue %s", err)
		}
		if d.Partitions < 0 || d.Partitions > 1024 {
			return relay.Destination{}, fail("Partitions %d: want 0 to 1024", d.Partitions)
		}
		out.Kind, out.Stream = relay.Queue, broker.TopologyFor(d.Queue, 0)
		out.Stream.Partitions = d.Partitions
	case d.Exchange != "":
		if err := checkField(d.Exchange, maxShortstr, false); err != nil {
			return relay.Destination{}, fail("Exchange %s", err)
		}
		if err := checkField(d.RoutingKey, maxShortstr, false); err != nil {
			return relay.Destination{}, fail("RoutingKey %s", err)
		}
		out.Kind, out.Exchange, out.RoutingKey = relay.Exchange, d.Exchange, d.RoutingKey
	default:
		u, err := url.Parse(d.URL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return relay.Destination{}, fail("URL %q: want an absolute http or https URL", redact.URL(d.URL))
		}
		if err := checkHeader(d.Header); err != nil {
			return relay.Destination{}, fail("Header: %v", err)
		}
		out.Kind, out.URL, out.Header, out.Request = relay.HTTP, d.URL, d.Header.Clone(), d.Request
		if d.FinalStatuses != nil {
			out.Final = slices.Clone(d.FinalStatuses)
		}
	}
	return out, nil
}

// checkHeader refuses a header net/http would refuse to send on every
// attempt, or one that idem or net/http sets itself. It quotes names,
// never values.
func checkHeader(h http.Header) error {
	for k, vs := range h {
		if k == "" || strings.IndexFunc(k, func(r rune) bool { return !isTokenChar(r) }) >= 0 {
			return fmt.Errorf("%q is not a valid header name", k)
		}
		if relay.ReservedHeader(k) {
			return fmt.Errorf("%s: idem or net/http sets this header itself", http.CanonicalHeaderKey(k))
		}
		for _, v := range vs {
			if strings.IndexFunc(v, func(r rune) bool { return (r < ' ' && r != '\t') || r == 0x7f }) >= 0 {
				return fmt.Errorf("%s: a value holds a control character", http.CanonicalHeaderKey(k))
			}
		}
	}
	return nil
}

// isTokenChar reports whether r may appear in a header name (RFC 9110's
// tchar).
func isTokenChar(r rune) bool {
	return r < 0x7f && (r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("!#$%&'*+-.^_`|~", r))
}

// relayedAll checks every destination and returns them as the relay takes
// them.
func relayedAll(ds map[string]Destination) (map[string]relay.Destination, error) {
	if len(ds) == 0 {
		return nil, errors.New("outbox: Destinations is required")
	}
	order := make([]string, 0, len(ds))
	for name := range ds {
		order = append(order, name)
	}
	sort.Strings(order) // the first bad one, every time
	out := make(map[string]relay.Destination, len(ds))
	for _, name := range order {
		rd, err := ds[name].relayed(name)
		if err != nil {
			return nil, err
		}
		out[name] = rd
	}
	return out, nil
}
