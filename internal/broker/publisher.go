package broker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// HeaderPublishID marks every message a Publisher sends with an ID of its
// own, so that a basic.return is matched to the publish it answers.
const HeaderPublishID = "x-idem-publish-id"

// Message is one publish: where it goes and what it carries. Every publish
// is mandatory, so that a message no queue takes comes back (Returned).
type Message struct {
	Exchange, Key string
	amqp.Publishing
	// Keep, if set, lets Publish fit a message whose header frame would
	// exceed the broker's frame_max: it drops the headers Keep refuses,
	// largest first, until the frame fits, and names them in
	// HeaderHeadersDropped (Result.Dropped). Unset, such a message is
	// Invalid.
	Keep func(header string) bool
}

// Outcome is how the broker answered one publish.
type Outcome int

const (
	// Unanswered: no answer came (the connection or channel was lost, the
	// context ended, or the message was never sent). The message may or
	// may not be in a queue; it says nothing about the message itself.
	Unanswered Outcome = iota
	// Confirmed: a queue took the message and the broker confirmed it.
	Confirmed
	// Returned: confirmed, but no queue was bound to take it.
	Returned
	// Nacked: the broker refused it with basic.nack on an open channel (a
	// queue at its length limit with reject-publish, say).
	Nacked
	// Refused: the broker closed the channel with a channel exception
	// (404 no such exchange, 403 access refused, 406 too large, …) while
	// the message was unanswered. The exception is the broker's answer to
	// one of the publishes then in flight, not necessarily to this one.
	Refused
	// Invalid: the message cannot be encoded (a short string over 255
	// bytes, a header the protocol cannot carry), or its header frame is
	// larger than the broker's frame_max, which would close the
	// connection. It was not sent.
	Invalid
)

var outcomeNames = [...]string{"unanswered", "confirmed", "returned", "nacked", "refused", "invalid"}

func (o Outcome) String() string { return outcomeNames[o] }

// Result is one publish's outcome, and for every outcome but Confirmed the
// error that says why.
type Result struct {
	Outcome Outcome
	Err     error
	// Dropped names the headers left out to fit the frame (Message.Keep).
	Dropped []string
}

// Answered reports whether the broker (or the client, for Invalid) said
// something about this message: only such an outcome may count against it.
func (r Result) Answered() bool { return r.Outcome != Unanswered }

// PublisherOptions configures a Publisher.
type PublisherOptions struct {
	// OnBlocked, if set, is called with each connection.blocked and
	// connection.unblocked notification. It must not block.
	OnBlocked func(amqp.Blocking)
}

// Publisher owns a connection with one confirm-mode channel, and is the one
// place that reads amqp091's notification channels for publishing: returns,
// the channel's and the connection's close, connection.blocked. One
// goroutine reads them all, each receive checks that the channel is still
// open, and it returns once the library closed them, so that no loop over
// them can spin after a connection loss and none of them is ever left
// unread (amqp091 drops a notification nobody takes within 5 s: a return
// dropped that way would pass for a confirmed publish).
type Publisher struct {
	conn   *amqp.Connection
	ch     *amqp.Channel
	socket *writeBounded // corked around a batch's publishes; nil: not dialOne's
	opts   PublisherOptions
	run    string // this publisher's ID, the prefix of every publish ID

	mu  sync.Mutex // one Publish at a time
	seq uint64

	returns  chan amqp.Return // unbuffered: see barrier
	barrier  chan chan struct{}
	ended    chan struct{} // closed once the channel has ended
	watching chan struct{} // closed when watch returns

	state    sync.Mutex
	err      error                  // why the channel or connection ended
	returned map[string]amqp.Return // by publish ID, for the Publish under way
	block    string                 // the broker's reason while it blocks the connection
	cleared  chan struct{}          // closed when the block ends; nil while unblocked
}

// NewPublisher takes conn over (Close closes it, and so does a failure
// here) and opens its confirm-mode channel.
func NewPublisher(conn *amqp.Connection, opts PublisherOptions) (*Publisher, error) {
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Confirm(false)
	}
	if err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("open a confirm-mode channel: %w", err)
	}
	var id [8]byte
	_, _ = rand.Read(id[:])
	p := &Publisher{
		conn: conn, ch: ch, socket: corkable(conn), opts: opts, run: hex.EncodeToString(id[:]),
		returns:  make(chan amqp.Return),
		barrier:  make(chan chan struct{}),
		ended:    make(chan struct{}),
		watching: make(chan struct{}),
		returned: map[string]amqp.Return{},
	}
	ch.NotifyReturn(p.returns)
	go p.watch(ch.NotifyClose(make(chan *amqp.Error, 1)), conn.NotifyClose(make(chan *amqp.Error, 1)),
		conn.NotifyBlocked(make(chan amqp.Blocking, 4)))
	return p, nil
}

// NewPublisherContext is NewPublisher bounded by ctx. amqp091 waits for
// channel.open and confirm.select's answers without a bound: a broker that
// goes silent just after the handshake holds them until the heartbeat
// gives up (15 s and more; never, if only the broker's heartbeats still
// come). If ctx ends first, the connection's socket is closed, which ends
// both waits, and the error is ctx's.
func NewPublisherContext(ctx context.Context, conn *amqp.Connection, opts PublisherOptions) (*Publisher, error) {
	stop := context.AfterFunc(ctx, func() {
		if w := corkable(conn); w != nil {
			_ = w.Conn.Close()
			return
		}
		_ = Close(conn) // bounded: CloseTimeout twice
	})
	p, err := NewPublisher(conn, opts)
	if !stop() { // ctx ended meanwhile, and its close ran or runs
		if err == nil {
			_ = p.Close()
		}
		return nil, fmt.Errorf("open a confirm-mode channel: %w", context.Cause(ctx))
	}
	return p, err
}

// watch reads every notification channel until the library has closed them
// all (it closes them when the connection ends; Close ends it).
func (p *Publisher) watch(chClosed, connClosed chan *amqp.Error, blocked chan amqp.Blocking) {
	defer close(p.watching)
	returns := p.returns
	for returns != nil || chClosed != nil || connClosed != nil || blocked != nil {
		select {
		case r, ok := <-returns:
			if !ok {
				returns = nil
				continue
			}
			if id, _ := r.Headers[HeaderPublishID].(string); id != "" {
				p.state.Lock()
				p.returned[id] = r
				p.state.Unlock()
			}
		case e, ok := <-chClosed:
			if !ok {
				chClosed = nil
				p.end(errors.New("the publishing channel closed"))
				close(p.ended)
				// A channel exception leaves the connection open: close
				// it, so that its notification channels close too.
				go Close(p.conn)
				continue
			}
			p.end(e)
		case e, ok := <-connClosed:
			if !ok {
				connClosed = nil
				continue
			}
			p.end(e)
		case b, ok := <-blocked:
			if !ok {
				blocked = nil
				p.setBlocked(amqp.Blocking{})
				continue
			}
			p.setBlocked(b)
			if p.opts.OnBlocked != nil {
				p.opts.OnBlocked(b)
			}
		case c := <-p.barrier:
			close(c)
		}
	}
}

// end records the first reason the publisher ended.
func (p *Publisher) end(err error) {
	p.state.Lock()
	defer p.state.Unlock()
	if p.err == nil {
		p.err = err
	}
}

func (p *Publisher) setBlocked(b amqp.Blocking) {
	p.state.Lock()
	defer p.state.Unlock()
	switch {
	case b.Active && p.cleared == nil:
		p.block, p.cleared = b.Reason, make(chan struct{})
	case b.Active:
		p.block = b.Reason
	case p.cleared != nil:
		close(p.cleared)
		p.block, p.cleared = "", nil
	}
}

// Blocked returns why the broker blocks the connection ("" if it does
// not) and a channel closed when the block ends (nil if it does not).
func (p *Publisher) Blocked() (reason string, cleared <-chan struct{}) {
	p.state.Lock()
	defer p.state.Unlock()
	return p.block, p.cleared
}

// Done is closed once the publisher's channel has ended; Err says why.
func (p *Publisher) Done() <-chan struct{} { return p.ended }

// Err returns why the publisher ended, or nil while it runs.
func (p *Publisher) Err() error {
	select {
	case <-p.ended:
	default:
		return nil
	}
	p.state.Lock()
	defer p.state.Unlock()
	return p.err
}

// Close closes the connection (within about 2 × CloseTimeout, whatever the
// broker does: see broker.Close), and returns once every notification
// channel was closed and read to its end.
func (p *Publisher) Close() error {
	err := Close(p.conn)
	<-p.watching
	return err
}

// Declare runs declare (a topology's declarations, say) on the
// publisher's channel, between publishes.
func (p *Publisher) Declare(declare func(*amqp.Channel) error) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return declare(p.ch)
}

// Publish sends msgs, mandatory and in order, and waits for the broker's
// answer to each, or for ctx to end. It never returns before every message
// has its outcome; messages without an answer are Unanswered. It writes
// nothing while the broker blocks the connection (a blocked connection is
// not read, and a write to it can wait for as long as the alarm lasts).
func (p *Publisher) Publish(ctx context.Context, msgs ...Message) []Result {
	p.mu.Lock()
	defer p.mu.Unlock()
	results := make([]Result, len(msgs))
	if err := p.Err(); err != nil {
		return unanswered(results, fmt.Errorf("not sent: %w", err))
	}
	if why, _ := p.Blocked(); why != "" {
		return unanswered(results, fmt.Errorf("not sent: the broker blocks publishing (%s)", why))
	}
	if err := ctx.Err(); err != nil {
		return unanswered(results, fmt.Errorf("not sent: %w", err))
	}
	p.state.Lock()
	clear(p.returned)
	p.state.Unlock()

	ids := make([]string, len(msgs))
	confirms := make([]*amqp.DeferredConfirmation, len(msgs))
	var sendErr error
	// The batch leaves in a few writes rather than one a message (see
	// writeBounded), each by ctx's deadline; the publishes never wait for
	// the broker, and the socket is uncorked before the wait for their
	// confirms.
	until, _ := ctx.Deadline()
	p.socket.cork(until)
	for i, m := range msgs {
		if err := validate(m); err != nil {
			results[i] = Result{Outcome: Invalid, Err: err}
			continue
		}
		if sendErr != nil {
			results[i] = Result{Err: fmt.Errorf("not sent: %w", sendErr)}
			continue
		}
		p.seq++
		ids[i] = p.run + "-" + strconv.FormatUint(p.seq, 10)
		pub := m.Publishing
		pub.Headers = make(amqp.Table, len(m.Headers)+1)
		for k, v := range m.Headers {
			pub.Headers[k] = v
		}
		pub.Headers[HeaderPublishID] = ids[i]
		dropped, err := p.fitFrame(&pub, m.Keep)
		if err != nil {
			results[i] = Result{Outcome: Invalid, Err: err}
			continue
		}
		results[i].Dropped = dropped
		dc, err := p.ch.PublishWithDeferredConfirmWithContext(ctx, m.Exchange, m.Key, true, false, pub)
		if err != nil {
			sendErr = err
			results[i] = Result{Err: fmt.Errorf("not sent: %w", err)}
			continue
		}
		confirms[i] = dc
	}
	p.socket.uncork()
	acked := false
	for i, dc := range confirms {
		if dc == nil {
			continue
		}
		select {
		case <-dc.Done():
		case <-ctx.Done():
			results[i] = Result{Err: fmt.Errorf("no confirm: %w", ctx.Err())}
			confirms[i] = nil
			continue
		}
		acked = acked || dc.Acked()
	}
	if acked {
		p.returnsRead()
	}
	for i, dc := range confirms {
		if dc == nil {
			continue
		}
		dropped := results[i].Dropped
		results[i] = p.answer(ctx, dc.Acked(), ids[i])
		results[i].Dropped = dropped
	}
	return results
}

// returnsRead returns once watch has recorded every basic.return the
// library read before the acks that arrived so far. The broker sends a
// return before its message's ack, and the library hands it to watch
// (unbuffered) before it reads the ack: once watch answers the barrier,
// the return is in p.returned. One barrier serves a whole batch of acks.
func (p *Publisher) returnsRead() {
	c := make(chan struct{})
	select {
	case p.barrier <- c:
		<-c
	case <-p.watching:
	}
}

// FrameMax is the largest frame the broker takes on the publisher's
// connection, in bytes: the frame_max negotiated at its handshake (0: no
// limit).
func (p *Publisher) FrameMax() int { return p.conn.Config.FrameSize }

// fitFrame refuses pub if its header frame exceeds FrameMax, unless keep
// lets it drop headers until it fits (see Message.Keep).
func (p *Publisher) fitFrame(pub *amqp.Publishing, keep func(string) bool) ([]string, error) {
	limit := p.FrameMax()
	if limit <= 0 {
		return nil, nil
	}
	size := headerFrameSize(*pub)
	if size <= limit {
		return nil, nil
	}
	if keep != nil {
		return fit(pub, limit, func(k string) bool { return k == HeaderPublishID || keep(k) })
	}
	return nil, fmt.Errorf("the header frame is %d bytes, more than the broker's frame_max (%d): the broker would close the connection", size, limit)
}

// answer classifies a confirm that arrived: ack (Confirmed, or Returned if
// a basic.return preceded it), or nack, which amqp091 also reports for
// every publish still unconfirmed when the channel ends. An ack is
// classified after returnsRead.
func (p *Publisher) answer(ctx context.Context, acked bool, id string) Result {
	if acked {
		p.state.Lock()
		r, returned := p.returned[id]
		p.state.Unlock()
		if returned {
			return Result{Outcome: Returned, Err: fmt.Errorf("returned %d %s: no queue is bound to exchange %q with routing key %q",
				r.ReplyCode, r.ReplyText, r.Exchange, r.RoutingKey)}
		}
		return Result{Outcome: Confirmed}
	}
	if !p.ch.IsClosed() {
		return Result{Outcome: Nacked, Err: errors.New("the broker refused the message (basic.nack)")}
	}
	// The channel ended: wait for watch to have read why.
	select {
	case <-p.ended:
	case <-ctx.Done():
		return Result{Err: fmt.Errorf("no confirm: the channel closed: %w", ctx.Err())}
	}
	err := p.Err()
	var ae *amqp.Error
	// A soft error is a channel.close from the broker, whatever happened
	// to the connection since (watch closes it at once): a connection's
	// loss reaches the channel as a hard error, or as none.
	if errors.As(err, &ae) && ae.Server && ae.Recover {
		return Result{Outcome: Refused, Err: fmt.Errorf("the broker closed the channel: %w", ae)}
	}
	return Result{Err: fmt.Errorf("no confirm: the connection was lost: %w", err)}
}

func unanswered(results []Result, err error) []Result {
	for i := range results {
		results[i] = Result{Err: err}
	}
	return results
}

// validate refuses what amqp091 cannot encode: it would fail the write and
// close the whole connection, taking every other publish in flight with it.
func validate(m Message) error {
	short := []struct{ name, v string }{
		{"exchange", m.Exchange}, {"routing key", m.Key}, {"content type", m.ContentType},
		{"content encoding", m.ContentEncoding}, {"correlation ID", m.CorrelationId}, {"reply-to", m.ReplyTo},
		{"expiration", m.Expiration}, {"message ID", m.MessageId}, {"type", m.Type}, {"user ID", m.UserId}, {"app ID", m.AppId},
	}
	for _, s := range short {
		if len(s.v) > MaxShortString {
			return fmt.Errorf("the %s is %d bytes; AMQP allows %d", s.name, len(s.v), MaxShortString)
		}
	}
	for k := range m.Headers {
		if len(k) > MaxShortString {
			return fmt.Errorf("header name %.40q… is %d bytes; AMQP allows %d", k, len(k), MaxShortString)
		}
	}
	if err := m.Headers.Validate(); err != nil {
		return fmt.Errorf("headers: %w", err)
	}
	return nil
}

// MaxShortString is the most bytes an AMQP short string (exchange, routing
// key, type, content type, message ID, header name) holds.
const MaxShortString = 255

// CloseTimeout bounds the wait for the broker's close-ok when Close closes
// a connection, and then again the wait for the socket's end.
const CloseTimeout = 2 * time.Second

// WriteTimeout bounds one write to a broker connection. The broker stops
// reading a connection it blocks (a resource alarm); without a bound, a
// write caught by the block would wait as long as the alarm lasts.
const WriteTimeout = 30 * time.Second
