package broker

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	neturl "net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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

// Dial is DialContext without a context: each node's connect and
// handshake are bounded by dialTimeout alone. For tests; anything that
// runs until a context ends dials with DialContext, so that shutdown ends
// a dial that a silent broker holds.
func Dial(urls []string, start int, cfg amqp.Config) (*amqp.Connection, int, error) {
	return DialContext(context.Background(), urls, start, cfg)
}

// DialContext connects to one of urls: urls[start % len(urls)] first, then
// the others in turn, each within dialTimeout and ctx: ctx ending ends the
// TCP connect or the AMQP handshake under way at once. It returns the
// connection and the index of the URL that took it. If none does, the error
// joins each URL's error, so that errors.Is and errors.As see why each
// failed.
//
// Every connection has a bound on how long a silent peer can hold it: a
// heartbeat (DefaultHeartbeat unless cfg sets one), WriteTimeout on every
// write, and Close's bound on its close.
//
// A cfg.FrameSize above the broker's frame_max is how large a frame the
// connection reads; it still writes within the broker's (see ReadFrameMax).
func DialContext(ctx context.Context, urls []string, start int, cfg amqp.Config) (*amqp.Connection, int, error) {
	if len(urls) == 0 {
		return nil, 0, errors.New("no AMQP URL")
	}
	if cfg.Heartbeat == 0 {
		cfg.Heartbeat = DefaultHeartbeat
	}
	var errs []error
	for k := range urls {
		if err := ctx.Err(); err != nil {
			errs = append(errs, err)
			break
		}
		i := (start + k) % len(urls)
		conn, err := dialOne(ctx, urls[i], cfg)
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

// dialOne connects to url. Unless cfg brings its own dialler, the socket is
// idem's: connected and handshaken within dialTimeout and ctx, every write
// bounded, and kept so that Close can end the connection whatever the
// broker does.
func dialOne(ctx context.Context, url string, cfg amqp.Config) (*amqp.Connection, error) {
	if cfg.Dial != nil {
		return amqp.DialConfig(url, cfg)
	}
	var socket atomic.Pointer[writeBounded]
	var wide *wideFrames // a FrameSize above the broker's is read (ReadFrameMax)
	// A wide connection's frame reader must sit above TLS, and amqp091
	// puts TLS above whatever the dialler returns: on amqps:// the
	// dialler makes the TLS connection itself, as amqp091 would, and
	// amqp091 is given the same URL as amqp:// on the same port.
	var wideTLS *tls.Config
	if cfg.FrameSize > 0 {
		var err error
		if url, wideTLS, err = tlsBelowFrames(url, cfg.TLSClientConfig); err != nil {
			return nil, err
		}
	}
	cfg.Dial = func(network, addr string) (net.Conn, error) {
		d := net.Dialer{Timeout: dialTimeout}
		c, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		// The handshake's deadline; amqp091 clears it once the
		// connection is open.
		deadline := time.Now().Add(dialTimeout)
		if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
			deadline = d
		}
		if err := c.SetDeadline(deadline); err != nil {
			c.Close()
			return nil, err
		}
		wb := &writeBounded{Conn: c}
		socket.Store(wb)
		if err := ctx.Err(); err != nil { // ended before the socket was stored
			c.Close()
			return nil, err
		}
		if cfg.FrameSize > 0 {
			var below net.Conn = wb
			if wideTLS != nil {
				tc := tls.Client(below, wideTLS)
				if err := tc.HandshakeContext(ctx); err != nil {
					c.Close()
					return nil, err
				}
				below = tc
			}
			wide = &wideFrames{Conn: below, readMax: uint32(cfg.FrameSize)}
			return wide, nil
		}
		return wb, nil
	}
	// A context cancelled during the handshake ends it.
	stop := context.AfterFunc(ctx, func() {
		if wb := socket.Load(); wb != nil {
			wb.Conn.Close()
		}
	})
	conn, err := amqp.DialConfig(url, cfg)
	if !stop() && err == nil {
		conn.Close()
		return nil, ctx.Err()
	}
	if err != nil {
		return nil, err
	}
	if wide != nil {
		wide.settle(conn)
	}
	sockets.Store(conn, socket.Load())
	closed := conn.NotifyClose(make(chan *amqp.Error, 1))
	go func() {
		for range closed { // until the library closes it
		}
		sockets.Delete(conn)
	}()
	return conn, nil
}

// tlsBelowFrames returns, for an amqps:// URL, the same URL as amqp:// on
// its port, and the TLS configuration amqp091 would use for it: own if
// set (a clone), else from the URL's cacertfile, certfile, keyfile and
// server_name_indication (the system's roots without a cacertfile), with
// the URL's host as the server name unless one is set. Any other URL is
// returned as it is, with no TLS configuration.
func tlsBelowFrames(rawURL string, own *tls.Config) (string, *tls.Config, error) {
	uri, err := amqp.ParseURI(rawURL)
	if err != nil || uri.Scheme != "amqps" {
		return rawURL, nil, nil // amqp091 says what is wrong with it
	}
	var cfg *tls.Config
	if own != nil {
		cfg = own.Clone()
	} else {
		cfg = &tls.Config{ServerName: uri.ServerName, MinVersion: tls.VersionTLS12}
		if uri.CACertFile != "" {
			pem, err := os.ReadFile(uri.CACertFile)
			if err != nil {
				return "", nil, fmt.Errorf("read CA certificate: %w", err)
			}
			cfg.RootCAs = x509.NewCertPool()
			cfg.RootCAs.AppendCertsFromPEM(pem)
		}
		if uri.CertFile != "" && uri.KeyFile != "" {
			cert, err := tls.LoadX509KeyPair(uri.CertFile, uri.KeyFile)
			if err != nil {
				return "", nil, fmt.Errorf("load client certificate: %w", err)
			}
			cfg.Certificates = []tls.Certificate{cert}
		}
	}
	if cfg.ServerName == "" {
		cfg.ServerName = uri.Host
	}
	u, err := neturl.Parse(rawURL)
	if err != nil {
		return "", nil, err
	}
	u.Scheme = "amqp"
	if u.Port() == "" {
		u.Host = net.JoinHostPort(u.Hostname(), strconv.Itoa(uri.Port))
	}
	return u.String(), cfg, nil
}

// sockets maps each open connection dialOne made to its socket.
var sockets sync.Map

// Close closes conn: the close handshake, given CloseTimeout, and then, if
// the broker has not answered, the socket. A broker that reads nothing (a
// connection it blocks during a resource alarm) still sends heartbeats,
// and each one moves amqp091's read deadline on: the handshake alone could
// wait as long as the alarm lasts.
func Close(conn *amqp.Connection) error {
	done := make(chan error, 1)
	go func() { done <- conn.CloseDeadline(time.Now().Add(CloseTimeout)) }()
	t := time.NewTimer(CloseTimeout)
	defer t.Stop()
	select {
	case err := <-done:
		return closeErr(err)
	case <-t.C:
	}
	if w := corkable(conn); w != nil {
		w.Conn.Close()
	}
	t.Reset(CloseTimeout)
	select {
	case err := <-done:
		return closeErr(err)
	case <-t.C:
		return errors.New("close: the connection did not end")
	}
}

func closeErr(err error) error {
	if errors.Is(err, amqp.ErrClosed) {
		return nil
	}
	return err
}

// PublishingConnectionSuffix ends the name of a consumer's publishing
// connection: consumer.Config.ConnectionName + PublishingConnectionSuffix.
const PublishingConnectionSuffix = "-publish"

// DefaultHeartbeat is the heartbeat Dial asks for: amqp091 ends a
// connection whose peer stays silent for 1.5 of them (15 s).
const DefaultHeartbeat = 10 * time.Second

// dialTimeout bounds the TCP connect and the AMQP handshake.
const dialTimeout = 30 * time.Second

// writeBounded is the socket under every connection dialOne makes. It sets
// a write deadline of WriteTimeout before every write, and while it is
// corked it holds what the library writes and writes it in one go when
// uncorked (or once corkMax bytes are held).
//
// amqp091 flushes its buffer after every message it publishes: one write,
// and one TCP segment for the broker to read, a message. A Publisher that
// publishes a batch corks the socket around it, so that the batch leaves
// in a few writes and arrives in a few reads. What else the library writes
// meanwhile (a heartbeat, a close) waits in the batch's writes, which
// never wait for the broker: the publishes write nothing but into the held
// bytes, and the Publisher uncorks before it waits for a confirm.
type writeBounded struct {
	net.Conn

	mu     sync.Mutex
	corked bool
	until  time.Time // while corked, no write of held bytes outlasts it (zero: none but WriteTimeout)
	held   []byte
	err    error        // why a write of held bytes failed: every later write fails with it
	writes atomic.Int64 // writes to the socket, for the tests
}

// corkMax is the most bytes a corked socket holds before it writes them.
const corkMax = 32 << 10

func (c *writeBounded) Write(b []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return 0, c.err
	}
	if !c.corked {
		return c.write(b)
	}
	c.held = append(c.held, b...)
	if len(c.held) >= corkMax {
		if err := c.flushLocked(); err != nil {
			return 0, err
		}
	}
	return len(b), nil
}

func (c *writeBounded) write(b []byte) (int, error) { return c.writeBy(b, time.Time{}) }

// writeBy writes b within WriteTimeout, and by until if that is sooner.
func (c *writeBounded) writeBy(b []byte, until time.Time) (int, error) {
	c.writes.Add(1)
	deadline := time.Now().Add(WriteTimeout)
	if !until.IsZero() && until.Before(deadline) {
		deadline = until
	}
	if err := c.Conn.SetWriteDeadline(deadline); err != nil {
		return 0, err
	}
	return c.Conn.Write(b)
}

// flushLocked writes the held bytes, by c.until. The library took them as
// written, so if the write fails (or does not end by then) the socket is
// closed: its reader fails, and the library ends the connection, and with
// it every publish it did not confirm (Unanswered). Callers hold c.mu.
func (c *writeBounded) flushLocked() error {
	if len(c.held) == 0 {
		return nil
	}
	_, err := c.writeBy(c.held, c.until)
	if cap(c.held) > 2*corkMax {
		c.held = nil // one large message's worth is not kept
	} else {
		c.held = c.held[:0]
	}
	if err != nil {
		c.err = fmt.Errorf("a corked write: %w", err)
		_ = c.Conn.Close()
	}
	return err
}

// cork holds the writes until uncork; the writes of what it holds end by
// until (zero: within WriteTimeout), so that a broker that stops reading
// holds a batch no longer than its publish's context: a relay's pass holds
// its lanes while it publishes, and its session's bound is far below
// WriteTimeout. A nil c (a connection dialled with a caller's own dialler)
// does nothing.
func (c *writeBounded) cork(until time.Time) {
	if c == nil {
		return
	}
	c.mu.Lock()
	c.corked, c.until = true, until
	c.mu.Unlock()
}

// uncork writes what cork held, and lets later writes through.
func (c *writeBounded) uncork() {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	_ = c.flushLocked() // a failure ends the connection (flushLocked)
	c.corked, c.until = false, time.Time{}
}

// corkable returns the socket of a connection dialOne made, nil for any
// other.
func corkable(conn *amqp.Connection) *writeBounded {
	if w, ok := sockets.Load(conn); ok {
		return w.(*writeBounded)
	}
	return nil
}
