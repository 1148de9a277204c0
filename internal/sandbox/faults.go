package sandbox

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"strings"
	"sync"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/rs/zerolog"
)

// Faults is an embedded toxiproxy server: every Link it makes is a TCP proxy
// on loopback in front of one service, on which a test or a chaos run turns
// network faults on and off. Each fault is one of toxiproxy's toxics, on
// both directions of every connection of the link.
type Faults struct {
	srv *toxiproxy.ApiServer

	mu    sync.Mutex
	links []*Link
	n     int
}

// StartFaults starts an embedded toxiproxy server (no HTTP API: links are
// driven through their methods).
func StartFaults() *Faults {
	return &Faults{srv: toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())}
}

// Link is one proxied service: connect to Addr instead of the service.
type Link struct {
	name  string
	proxy *toxiproxy.Proxy

	mu     sync.Mutex
	toxics []string
}

// Link starts a proxy named name in front of upstream (host:port) on a free
// loopback port.
func (f *Faults) Link(name, upstream string) (*Link, error) {
	f.mu.Lock()
	f.n++
	name = fmt.Sprintf("%s-%d", name, f.n)
	f.mu.Unlock()
	p := toxiproxy.NewProxy(f.srv, name, "127.0.0.1:0", upstream)
	if err := f.srv.Collection.Add(p, true); err != nil {
		return nil, fmt.Errorf("sandbox: faults: link %s: %w", name, err)
	}
	l := &Link{name: name, proxy: p}
	f.mu.Lock()
	f.links = append(f.links, l)
	f.mu.Unlock()
	return l, nil
}

// LinkURL starts a link named name in front of the host:port that rawURL
// (a postgres://, redis:// or amqp:// URL naming its port) names, and
// returns it with rawURL pointed at the link.
func (f *Faults) LinkURL(name, rawURL string) (*Link, string, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, "", fmt.Errorf("sandbox: faults: link %s: %w", name, err)
	}
	if u.Port() == "" {
		return nil, "", fmt.Errorf("sandbox: faults: link %s: %s names no port", name, u.Redacted())
	}
	l, err := f.Link(name, u.Host)
	if err != nil {
		return nil, "", err
	}
	u.Host = l.Addr()
	return l, u.String(), nil
}

// Close stops every link.
func (f *Faults) Close() {
	_ = f.srv.Collection.Clear()
}

// Addr is the host:port that reaches the service through the link.
func (l *Link) Addr() string { return l.proxy.Listen }

// Port is Addr's port.
func (l *Link) Port() string {
	_, port, _ := net.SplitHostPort(l.Addr())
	return port
}

// Blackhole drops every byte both ways and closes nothing, as a link whose
// packets are lost does: connections stay open, silent. New connections are
// accepted and silent too. Unlike a real network, Heal then closes (FIN)
// every connection the blackhole silenced, both ways: toxiproxy's timeout
// toxic ends its connections when it is removed. The proxy's own kernel
// keeps acknowledging, so TCP keepalive and user timeouts never fire; only
// the application's own deadlines and heartbeats notice.
func (l *Link) Blackhole() error {
	return l.add("timeout", `{"timeout": 0}`)
}

// Reset closes every connection as soon as data flows on it, until Heal:
// with a TCP reset for the connections opened while it is on, and a plain
// close (FIN) for those already open (toxiproxy sets SO_LINGER 0 only on
// connections it opens with the toxic in place).
func (l *Link) Reset() error {
	return l.add("reset_peer", `{"timeout": 0}`)
}

// Latency delays every chunk by d (± jitter), both ways.
func (l *Link) Latency(d, jitter time.Duration) error {
	return l.add("latency", fmt.Sprintf(`{"latency": %d, "jitter": %d}`, d.Milliseconds(), jitter.Milliseconds()))
}

// LatencyOneWay delays every chunk from the service to the client by d, a
// whole number of milliseconds (toxiproxy's unit), so that each round trip
// takes d longer: a service d away, round trip. In toxiproxy v2.5.0 each
// chunk is stamped when the proxy reads it (stream.ChanWriter.Write) and
// the latency toxic sleeps until that stamp plus d (latency.go: sleep :=
// delay - time.Since(c.Timestamp)), not d after the chunk before it went
// out: chunks that arrive 50µs apart leave 50µs apart, so pipelined
// statements are not serialized. The upstream direction is left alone.
func (l *Link) LatencyOneWay(d time.Duration) error {
	if d <= 0 || d%time.Millisecond != 0 {
		return fmt.Errorf("sandbox: latency on %s: %s is not a positive whole number of milliseconds", l.name, d)
	}
	return l.addStream("latency", "downstream", fmt.Sprintf(`{"latency": %d, "jitter": 0}`, d.Milliseconds()))
}

// CutAfter closes each connection once bytes more have gone from the
// client to the service.
func (l *Link) CutAfter(bytes int) error {
	return l.addStream("limit_data", "upstream", fmt.Sprintf(`{"bytes": %d}`, bytes))
}

// Repoint sends the link to upstream (host:port) instead, on the same
// address: the connections open now close, and new ones reach upstream, as
// when a virtual address or a DNS name moves to another server. The
// link's faults stay on.
func (l *Link) Repoint(upstream string) error {
	if err := l.proxy.Update(&toxiproxy.Proxy{Listen: l.Addr(), Upstream: upstream, Enabled: true}); err != nil {
		return fmt.Errorf("sandbox: repoint %s to %s: %w", l.name, upstream, err)
	}
	return nil
}

// Heal removes every fault; connections a fault closed stay closed (a
// blackhole's included, see Blackhole), the others flow again.
func (l *Link) Heal() error {
	l.mu.Lock()
	names := l.toxics
	l.toxics = nil
	l.mu.Unlock()
	var errs []string
	for _, n := range names {
		if err := l.proxy.Toxics.RemoveToxic(context.Background(), n); err != nil {
			errs = append(errs, err.Error())
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("sandbox: heal %s: %s", l.name, strings.Join(errs, "; "))
	}
	return nil
}

func (l *Link) add(kind, attrs string) error {
	for _, stream := range []string{"upstream", "downstream"} {
		if err := l.addStream(kind, stream, attrs); err != nil {
			return err
		}
	}
	return nil
}

func (l *Link) addStream(kind, stream, attrs string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	name := fmt.Sprintf("%s_%s_%d", kind, stream, len(l.toxics))
	body := fmt.Sprintf(`{"name": %q, "type": %q, "stream": %q, "toxicity": 1, "attributes": %s}`, name, kind, stream, attrs)
	if _, err := l.proxy.Toxics.AddToxicJson(strings.NewReader(body)); err != nil {
		return fmt.Errorf("sandbox: %s on %s: %w", kind, l.name, err)
	}
	l.toxics = append(l.toxics, name)
	return nil
}
