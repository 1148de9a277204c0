package sandbox

import (
	"fmt"
	"net"
	"sync"
	"time"
)

// DelayProxy is a TCP proxy that delivers every byte a fixed delay after it
// arrived, in both directions: a far-away server, on loopback. Each round
// trip through it costs two delays more.
type DelayProxy struct {
	ln     net.Listener
	target string
	delay  time.Duration

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
}

// StartDelayProxy listens on a free loopback port and forwards every
// connection to target with delay added each way.
func StartDelayProxy(target string, delay time.Duration) (*DelayProxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("sandbox: proxy: %w", err)
	}
	return serveDelayProxy(ln, target, delay), nil
}

// serveDelayProxy forwards every connection ln accepts to target, with
// delay added each way.
func serveDelayProxy(ln net.Listener, target string, delay time.Duration) *DelayProxy {
	p := &DelayProxy{ln: ln, target: target, delay: delay, conns: map[net.Conn]struct{}{}}
	go p.serve()
	return p
}

// Addr is the host:port to connect to instead of the target.
func (p *DelayProxy) Addr() string { return p.ln.Addr().String() }

// Close stops listening and cuts every proxied connection.
func (p *DelayProxy) Close() {
	p.mu.Lock()
	p.closed = true
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.ln.Close()
}

func (p *DelayProxy) track(cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
	return true
}

func (p *DelayProxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		go func() {
			u, err := net.Dial("tcp", p.target)
			if err != nil || !p.track(c, u) {
				c.Close()
				if u != nil {
					u.Close()
				}
				return
			}
			go p.pipe(u, c)
			p.pipe(c, u)
		}()
	}
}

// pipe copies src to dst, writing each chunk delay after it was read; order
// is kept.
func (p *DelayProxy) pipe(dst, src net.Conn) {
	type chunk struct {
		at time.Time
		b  []byte
	}
	q := make(chan chunk, 4096)
	go func() {
		defer close(q)
		for {
			buf := make([]byte, 32<<10)
			n, err := src.Read(buf)
			if n > 0 {
				q <- chunk{time.Now().Add(p.delay), buf[:n]}
			}
			if err != nil {
				return
			}
		}
	}()
	for c := range q {
		time.Sleep(time.Until(c.at))
		if _, err := dst.Write(c.b); err != nil {
			break
		}
	}
	dst.Close()
	src.Close()
	p.mu.Lock()
	delete(p.conns, dst)
	delete(p.conns, src)
	p.mu.Unlock()
}
