package sandbox

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
)

// Method names an AMQP 0-9-1 method by class and method ID.
type Method struct{ Class, ID uint16 }

// The methods tests cut connections at.
var (
	ConnectionStartOk = Method{10, 11}
	ConnectionOpen    = Method{10, 40}
	BasicPublish      = Method{60, 40}
	BasicReturn       = Method{60, 50}
	BasicAck          = Method{60, 80}
	BasicNack         = Method{60, 120}
)

// Direction is which way a frame travels through an AMQPCut.
type Direction int

const (
	// ToServer: from the client to the broker.
	ToServer Direction = iota
	// ToClient: from the broker to the client.
	ToClient
)

// Cut says where an AMQPCut ends a connection: before forwarding the
// After+1-th frame of Method that travels Dir on a connection, or, with
// Next, the next such frame on any connection once the cut is armed.
// Close (the default) closes both sockets; Stall keeps them open and
// forwards nothing more either way, as a dropped link does.
type Cut struct {
	Dir    Direction
	Method Method
	After  int
	Next   bool
	Stall  bool
}

// AMQPCut is a TCP proxy in front of a RabbitMQ node that reads the AMQP
// frames going through it and can end a connection at an exact protocol
// point: at the first basic.publish, between a basic.return and its
// basic.ack, right after the client's connection.start-ok. Each armed Cut
// ends one connection, the next to reach its point; connections are
// forwarded untouched otherwise. Drop and DropWhere close connections at
// once, all of them or those of a client-provided name.
type AMQPCut struct {
	ln     net.Listener
	target string

	mu     sync.Mutex
	cuts   []Cut
	done   int // how many cuts fired
	conns  map[*link]struct{}
	closed bool
	stall  func(name string) bool // see StallWhere; nil: none
}

// StartAMQPCut listens on a free loopback port and forwards every
// connection to target (host:port).
func StartAMQPCut(target string) (*AMQPCut, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("sandbox: amqp cut: %w", err)
	}
	p := &AMQPCut{ln: ln, target: target, conns: map[*link]struct{}{}}
	go p.serve()
	return p, nil
}

// Addr is the host:port the proxy listens on.
func (p *AMQPCut) Addr() string { return p.ln.Addr().String() }

// URL returns amqpURL (whose host the proxy stands in front of) pointed at
// the proxy.
func (p *AMQPCut) URL(amqpURL string) string {
	scheme, rest, _ := strings.Cut(amqpURL, "://")
	auth, hostPath, ok := strings.Cut(rest, "@")
	if !ok {
		auth, hostPath = "", rest
	}
	_, path, _ := strings.Cut(hostPath, "/")
	if auth != "" {
		auth += "@"
	}
	return scheme + "://" + auth + p.ln.Addr().String() + "/" + path
}

// Arm queues cuts: each fires once, on the next connection to reach it.
func (p *AMQPCut) Arm(cuts ...Cut) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cuts = append(p.cuts, cuts...)
}

// Disarm drops the cuts that have not fired.
func (p *AMQPCut) Disarm() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cuts = nil
}

// Fired returns how many cuts have fired.
func (p *AMQPCut) Fired() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.done
}

// Drop closes every proxied connection now, as a network fault does, and
// goes on forwarding new ones.
func (p *AMQPCut) Drop() {
	p.DropWhere(func(string) bool { return true })
}

// DropWhere closes, as Drop does, the connections whose client-provided
// name (connection_name, read from their connection.start-ok) match
// accepts, and returns how many it closed.
func (p *AMQPCut) DropWhere(match func(name string) bool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for l := range p.conns {
		if match(l.connName()) {
			l.client.Close()
			l.up.Close()
			n++
		}
	}
	return n
}

// StallWhere stalls, as a Cut with Stall does (both sockets open, nothing
// forwarded either way), every connection whose client-provided name match
// accepts: those open now at once, and each new one at its
// connection.start-ok, so that its handshake never completes, until
// Release. It returns how many open connections it stalled.
func (p *AMQPCut) StallWhere(match func(name string) bool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stall = match
	n := 0
	for l := range p.conns {
		if match(l.connName()) {
			l.stallNow()
			n++
		}
	}
	return n
}

// Release ends StallWhere for new connections; those it stalled stay
// silent until their client gives up on them.
func (p *AMQPCut) Release() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stall = nil
}

// Close stops listening and closes every proxied connection.
func (p *AMQPCut) Close() {
	p.mu.Lock()
	p.closed = true
	for l := range p.conns {
		l.client.Close()
		l.up.Close()
	}
	p.mu.Unlock()
	p.ln.Close()
}

func (p *AMQPCut) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		go p.handle(c)
	}
}

// link is one proxied connection; counts are per direction and method.
type link struct {
	p          *AMQPCut
	client, up net.Conn
	mu         sync.Mutex
	seen       map[Direction]map[Method]int
	name       string // the client's connection_name, once its start-ok passed
	stalled    chan struct{}
	stallOnce  sync.Once
}

func (p *AMQPCut) handle(c net.Conn) {
	u, err := net.Dial("tcp", p.target)
	if err != nil {
		c.Close()
		return
	}
	l := &link{p: p, client: c, up: u, seen: map[Direction]map[Method]int{ToServer: {}, ToClient: {}}, stalled: make(chan struct{})}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		c.Close()
		u.Close()
		return
	}
	p.conns[l] = struct{}{}
	p.mu.Unlock()
	var wg sync.WaitGroup
	wg.Go(func() { l.pipe(ToServer, u, c, 8) }) // the protocol header first
	wg.Go(func() { l.pipe(ToClient, c, u, 0) })
	wg.Wait()
	p.mu.Lock()
	delete(p.conns, l)
	p.mu.Unlock()
}

// pipe copies src to dst frame by frame, after skip raw bytes, and ends the
// link where an armed cut says.
func (l *link) pipe(dir Direction, dst, src net.Conn, skip int) {
	defer func() { dst.Close(); src.Close() }()
	r := bufio.NewReaderSize(src, 64<<10)
	if skip > 0 {
		if _, err := io.CopyN(dst, r, int64(skip)); err != nil {
			return
		}
	}
	hdr := make([]byte, 7)
	for {
		if _, err := io.ReadFull(r, hdr); err != nil {
			return
		}
		size := binary.BigEndian.Uint32(hdr[3:])
		frame := make([]byte, 7+int(size)+1)
		copy(frame, hdr)
		if _, err := io.ReadFull(r, frame[7:]); err != nil {
			return
		}
		if hdr[0] == 1 && size >= 4 { // a method frame
			m := Method{binary.BigEndian.Uint16(frame[7:]), binary.BigEndian.Uint16(frame[9:])}
			if dir == ToServer && m == ConnectionStartOk {
				l.mu.Lock()
				l.name = connectionName(frame[11:])
				l.mu.Unlock()
				l.p.mu.Lock()
				if l.p.stall != nil && l.p.stall(l.connName()) {
					l.stallNow()
				}
				l.p.mu.Unlock()
			}
			if stall, cut := l.check(dir, m); cut {
				if stall {
					l.stallNow()
					<-l.stalled
					io.Copy(io.Discard, r) // until either side gives up
				}
				return
			}
		}
		select {
		case <-l.stalled:
			io.Copy(io.Discard, r)
			return
		default:
		}
		if _, err := dst.Write(frame); err != nil {
			return
		}
	}
}

// check counts m travelling dir and reports whether an armed cut fires.
func (l *link) check(dir Direction, m Method) (stall, cut bool) {
	l.mu.Lock()
	n := l.seen[dir][m]
	l.seen[dir][m] = n + 1
	l.mu.Unlock()
	p := l.p
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, c := range p.cuts {
		if c.Dir == dir && c.Method == m && (c.Next || c.After == n) {
			p.cuts = append(p.cuts[:i], p.cuts[i+1:]...)
			p.done++
			return c.Stall, true
		}
	}
	return false, false
}

// stallNow silences the link: pipe forwards nothing more either way.
func (l *link) stallNow() { l.stallOnce.Do(func() { close(l.stalled) }) }

func (l *link) connName() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.name
}

// connectionName finds the connection_name client property in the
// arguments of a connection.start-ok: the key as a shortstr, then a
// longstr value ('S', a 32-bit length, the bytes). A search rather than a
// walk of the whole field table, which may nest tables of any type.
func connectionName(args []byte) string {
	key := append([]byte{byte(len("connection_name"))}, "connection_name"...)
	i := bytes.Index(args, append(key, 'S'))
	if i < 0 {
		return ""
	}
	v := args[i+len(key)+1:]
	if len(v) < 4 || uint64(len(v)-4) < uint64(binary.BigEndian.Uint32(v)) {
		return ""
	}
	return string(v[4 : 4+binary.BigEndian.Uint32(v)])
}
