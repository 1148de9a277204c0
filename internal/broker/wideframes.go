package broker

import (
	"crypto/tls"
	"encoding/binary"
	"net"
	"sync"
	"sync/atomic"

	amqp "github.com/rabbitmq/amqp091-go"
)

// ReadFrameMax is the amqp.Config.FrameSize of a connection that must read
// whatever the broker delivers (the DLQ tools'): 1 MiB.
//
// The broker bounds the frames it takes (frame_max, 128 KiB by default),
// not the header frames it sends: dead-lettering adds x-death to a message
// whose headers were already close to the limit, a quorum queue adds
// x-delivery-count on redelivery, and such a header frame comes in above
// frame_max. amqp091 refuses every frame above the frame_max it negotiated
// (ErrFrameTooLarge, the connection closes), and cannot negotiate more than
// the broker offers. So a connection dialled with a FrameSize above the
// broker's reads frames up to FrameSize while it writes within the
// broker's: see wideFrames.
const ReadFrameMax = 1 << 20

// wideFrames is the socket of a connection that reads larger frames than
// the broker's frame_max. It rewrites the frame_max of the broker's
// connection.tune to readMax on its way in, so that amqp091 settles on
// readMax and reads frames up to it, and the frame_max of amqp091's
// connection.tune-ok back to the broker's on its way out, which the broker
// requires (it refuses a tune-ok above what it offered). settle then sets
// the connection's FrameSize, which amqp091 splits bodies by, back to the
// broker's. Past the handshake it reads and writes through.
type wideFrames struct {
	net.Conn
	readMax uint32

	// Read's own, until the tune went by.
	in, out []byte // read and not yet scanned; scanned and not yet read
	tuned   bool

	mu        sync.Mutex
	brokerMax uint32 // the broker's frame_max, from its tune
	widened   bool   // the tune was rewritten; the tune-ok must be too
	pending   []byte // written and not yet sent, until the tune-ok went by
	through   atomic.Bool
}

// connection.tune and connection.tune-ok: class 10, methods 30 and 31.
// Their payload is class, method, channel-max (2 octets each), frame-max (4)
// and heartbeat (2).
var (
	tuneMethod   = []byte{0, 10, 0, 30}
	tuneOKMethod = []byte{0, 10, 0, 31}
)

const (
	tunePayload   = 12
	frameMaxAt    = 7 + 6 // in the frame: its header, then class, method, channel-max
	frameMethod   = 1
	frameEndOctet = 0xCE
)

// nextFrame returns the length of the complete frame at the start of b, or
// 0 if b holds only part of one.
func nextFrame(b []byte) int {
	if len(b) < 7 {
		return 0
	}
	n := 7 + int(binary.BigEndian.Uint32(b[3:7])) + 1
	if len(b) < n {
		return 0
	}
	return n
}

// isMethod reports whether frame f is the connection's method m.
func isMethod(f []byte, m []byte) bool {
	return len(f) == 7+tunePayload+1 && f[0] == frameMethod && f[1] == 0 && f[2] == 0 &&
		string(f[7:11]) == string(m) && f[len(f)-1] == frameEndOctet
}

func (c *wideFrames) Read(p []byte) (int, error) {
	for !c.tuned && len(c.out) == 0 {
		buf := make([]byte, 4096)
		n, err := c.Conn.Read(buf)
		c.in = append(c.in, buf[:n]...)
		c.scan()
		if err != nil {
			if len(c.out) == 0 {
				return 0, err
			}
			break
		}
	}
	if len(c.out) > 0 {
		n := copy(p, c.out)
		c.out = c.out[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}

// scan moves the complete frames read so far to out, the broker's tune
// rewritten, and once the tune went by, everything.
func (c *wideFrames) scan() {
	for !c.tuned {
		n := nextFrame(c.in)
		if n == 0 {
			if len(c.in) > 64<<10 { // no handshake sends this much: not a frame
				c.tuned = true
			}
			break
		}
		f := c.in[:n]
		if isMethod(f, tuneMethod) {
			c.tuned = true
			c.mu.Lock()
			c.brokerMax = binary.BigEndian.Uint32(f[frameMaxAt:])
			if c.brokerMax != 0 && c.readMax > c.brokerMax {
				binary.BigEndian.PutUint32(f[frameMaxAt:], c.readMax)
				c.widened = true
			}
			c.mu.Unlock()
		}
		c.out = append(c.out, f...)
		c.in = c.in[n:]
	}
	if c.tuned {
		c.out = append(c.out, c.in...)
		c.in = nil
		c.mu.Lock()
		if !c.widened { // nothing to rewrite on the way out
			c.through.Store(true)
		}
		c.mu.Unlock()
	}
}

func (c *wideFrames) Write(b []byte) (int, error) {
	if c.through.Load() {
		return c.Conn.Write(b)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.widened { // the tune has not come yet
		return c.Conn.Write(b)
	}
	// amqp091 writes whole frames, and the tune-ok is the first frame it
	// writes after the tune; only complete frames are sent on.
	c.pending = append(c.pending, b...)
	sent := 0
	for n := nextFrame(c.pending[sent:]); n > 0 && !c.through.Load(); n = nextFrame(c.pending[sent:]) {
		if f := c.pending[sent : sent+n]; isMethod(f, tuneOKMethod) {
			binary.BigEndian.PutUint32(f[frameMaxAt:], c.brokerMax)
			c.through.Store(true)
		}
		sent += n
	}
	if c.through.Load() {
		sent = len(c.pending)
	}
	if sent > 0 {
		if _, err := c.Conn.Write(c.pending[:sent]); err != nil {
			return 0, err
		}
	}
	c.pending = c.pending[sent:]
	return len(b), nil
}

// settle sets conn's FrameSize back to the broker's frame_max, which its
// writes must keep to, if the tune was rewritten. It runs before conn has
// a channel, so before anything reads FrameSize.
func (c *wideFrames) settle(conn *amqp.Connection) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.widened {
		conn.Config.FrameSize = int(c.brokerMax)
	}
}

// ConnectionState is the TLS state of the connection below, for
// amqp.Connection.ConnectionState (empty without TLS).
func (w *wideFrames) ConnectionState() tls.ConnectionState {
	if c, ok := w.Conn.(interface{ ConnectionState() tls.ConnectionState }); ok {
		return c.ConnectionState()
	}
	return tls.ConnectionState{}
}
