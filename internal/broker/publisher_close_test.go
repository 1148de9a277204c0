package broker_test

import (
	"bufio"
	"context"
	"encoding/binary"
	"io"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
)

// TestAChannelExceptionIsReportedAsTheBrokersAnswer: a batch whose
// first message goes to an exchange that does not exist. The broker answers
// it with channel.close 404; the connection stays up. That message must be
// Refused (the relay makes suspects of Refused rows, and a suspect refused
// alone goes dead). But answer() calls it Refused only if
// !p.conn.IsClosed(), and watch itself starts conn.CloseDeadline the moment
// the channel ends: once the close handshake completes before Publish gets
// to answer (Publish is still walking the rest of the batch), the
// exception's own message is reported Unanswered, "the connection was
// lost" -- which no caller may count against it.
func TestAChannelExceptionIsReportedAsTheBrokersAnswer(t *testing.T) {
	q := declare(t, nil)
	poison := broker.Message{Exchange: "idem.test.no-such-exchange-" + testenv.Name(t), Key: "k"}
	unanswered := 0
	const runs = 20
	for run := range runs {
		p := openPublisher(t, testenv.AMQPURL(), broker.PublisherOptions{})
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		msgs := []broker.Message{poison}
		for range 499 {
			msgs = append(msgs, msg(q, "x"))
		}
		rs := p.Publish(ctx, msgs...)
		cancel()
		if rs[0].Outcome != broker.Refused {
			unanswered++
			t.Logf("run %d: the 404's own message is %v: %v", run, rs[0].Outcome, rs[0].Err)
		}
		waitDone(t, p)
		require.ErrorContains(t, p.Err(), "404", "the channel ended by the broker's exception, not a lost connection")
		_ = p.Close()
	}
	require.Zero(t, unanswered, "%d of %d runs reported the broker's 404 answer as a lost connection", unanswered, runs)
}

// muteProxy stands in for a broker under a resource alarm: once muted it
// reads the client's socket but passes on nothing except heartbeat frames
// (a blocked RabbitMQ stops reading the connection and pauses its heartbeat
// monitor), while everything the broker sends -- its heartbeats -- still
// reaches the client.
type muteProxy struct {
	ln    net.Listener
	muted atomic.Bool
	// stalled: the proxy reads nothing more of the client's socket (a
	// broker that stops reading a connection: the client's writes wait).
	stalled atomic.Bool
	mu      sync.Mutex
	conns   []net.Conn
}

func startMuteProxy(t *testing.T) (*muteProxy, string) {
	t.Helper()
	u, err := amqp.ParseURI(testenv.AMQPURL())
	require.NoError(t, err)
	target := u.Host + ":" + strconv.Itoa(u.Port)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	m := &muteProxy{ln: ln}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			m.mu.Lock()
			m.conns = append(m.conns, c, up)
			m.mu.Unlock()
			go func() { _, _ = io.Copy(c, up); c.Close(); up.Close() }()
			go m.toServer(up, c)
		}
	}()
	t.Cleanup(m.Close)
	url := testenv.AMQPURL()
	return m, strings.Replace(url, u.Host+":"+strconv.Itoa(u.Port), ln.Addr().String(), 1)
}

func (m *muteProxy) toServer(dst, src net.Conn) {
	defer func() { dst.Close(); src.Close() }()
	r := bufio.NewReader(src)
	if _, err := io.CopyN(dst, r, 8); err != nil { // protocol header
		return
	}
	hdr := make([]byte, 7)
	for {
		for m.stalled.Load() {
			time.Sleep(10 * time.Millisecond)
		}
		if _, err := io.ReadFull(r, hdr); err != nil {
			return
		}
		frame := make([]byte, 7+int(binary.BigEndian.Uint32(hdr[3:]))+1)
		copy(frame, hdr)
		if _, err := io.ReadFull(r, frame[7:]); err != nil {
			return
		}
		if m.muted.Load() && hdr[0] != 8 { // 8: heartbeat
			continue
		}
		if _, err := dst.Write(frame); err != nil {
			return
		}
	}
}

func (m *muteProxy) Close() {
	m.ln.Close()
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, c := range m.conns {
		c.Close()
	}
}

// TestABatchTheBrokerStopsReadingEndsWithItsContext: the broker stops
// reading the connection mid-batch, the batch larger than the socket
// buffers between. The batch's held writes end by the publish's deadline,
// not WriteTimeout (30 s): a relay's pass, which holds its lanes while it
// publishes, ends within its session's bound (PublishTimeout and a
// second), so no other relay takes its lanes while it still publishes.
// Every message comes out Unanswered, and the connection ends.
func TestABatchTheBrokerStopsReadingEndsWithItsContext(t *testing.T) {
	q := declare(t, nil)
	proxy, url := startMuteProxy(t)
	conn, _, err := broker.Dial([]string{url}, 0, amqp.Config{})
	require.NoError(t, err)
	p, err := broker.NewPublisher(conn, broker.PublisherOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { proxy.Close(); _ = p.Close() })

	proxy.stalled.Store(true)
	body := strings.Repeat("x", 256<<10)
	msgs := make([]broker.Message, 128) // 32 MiB
	for i := range msgs {
		msgs[i] = msg(q, body)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	start := time.Now()
	rs := p.Publish(ctx, msgs...)
	took := time.Since(start)
	require.Less(t, took, broker.WriteTimeout/2, "a held write outlasted the publish's context (1 s)")
	for i, r := range rs {
		require.Equal(t, broker.Unanswered, r.Outcome, "message %d: %v", i, r.Err)
	}
	waitDone(t, p)
}

// TestOpeningAPublisherIsBoundedByItsContext: the broker goes silent once
// the handshake is over, but for its heartbeats: channel.open is never
// answered, and amqp091 would wait for it for ever (the relay opens its
// publisher inside a pass, which holds its lanes). NewPublisherContext
// returns ctx's error once ctx ends, and the connection is closed.
func TestOpeningAPublisherIsBoundedByItsContext(t *testing.T) {
	proxy, url := startMuteProxy(t)
	conn, _, err := broker.Dial([]string{url}, 0, amqp.Config{})
	require.NoError(t, err)
	proxy.muted.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		p, err := broker.NewPublisherContext(ctx, conn, broker.PublisherOptions{})
		if p != nil {
			_ = p.Close()
		}
		done <- err
	}()
	select {
	case err := <-done:
		require.ErrorIs(t, err, context.DeadlineExceeded)
	case <-time.After(10 * time.Second):
		proxy.Close() // let it return
		t.Fatalf("opening the publisher outlasted its context by 10 s: %v", <-done)
	}
	require.Eventually(t, conn.IsClosed, 5*time.Second, 10*time.Millisecond)

	// A context that does not end leaves a working publisher.
	conn, _, err = broker.Dial([]string{testenv.AMQPURL()}, 0, amqp.Config{})
	require.NoError(t, err)
	p, err := broker.NewPublisherContext(context.Background(), conn, broker.PublisherOptions{})
	require.NoError(t, err)
	defer p.Close()
	rs := p.Publish(context.Background(), msg(declare(t, nil), "a"))
	require.Equal(t, broker.Confirmed, rs[0].Outcome, "%v", rs[0].Err)
}

// TestCloseIsBoundedWhileTheBrokerReadsNothing: the broker stops
// reading the publishing connection (a memory or disk alarm) with a publish
// in flight. Publish returns it Unanswered when its context ends, and the
// caller closes the publisher (the relay does on every lost answer; the
// consumer at the end of its session). Close promises to wait at most
// CloseTimeout for close-ok; but CloseDeadline's deadline is only set once,
// and amqp091's heartbeater moves the read deadline to now+3*heartbeat
// each time a frame arrives -- and a blocked broker keeps sending
// heartbeats. Close then waits for as long as the alarm lasts. (The test
// dials with a 1 s heartbeat so that a broker frame surely falls inside
// CloseDeadline's first 2 s; TestCloseIsBoundedDuringAMemoryAlarm
// shows the same with the default heartbeat and a real alarm.)
func TestCloseIsBoundedWhileTheBrokerReadsNothing(t *testing.T) {
	q := declare(t, nil)
	proxy, url := startMuteProxy(t)
	conn, _, err := broker.Dial([]string{url}, 0, amqp.Config{Heartbeat: time.Second})
	require.NoError(t, err)
	p, err := broker.NewPublisher(conn, broker.PublisherOptions{})
	require.NoError(t, err)

	proxy.muted.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	rs := p.Publish(ctx, msg(q, "a"))
	require.Equal(t, broker.Unanswered, rs[0].Outcome, "%v", rs[0].Err)

	closed := make(chan struct{})
	start := time.Now()
	go func() { _ = p.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(broker.CloseTimeout + 8*time.Second):
		t.Errorf("Close still waiting %s after it began (CloseTimeout %s): the broker's heartbeats keep moving the read deadline",
			time.Since(start).Round(time.Second), broker.CloseTimeout)
		proxy.Close() // the alarm ends: let Close return
		<-closed
	}
}

// TestCloseIsBoundedDuringAMemoryAlarm is the same as
// TestCloseIsBoundedWhileTheBrokerReadsNothing on a real RabbitMQ
// node of the test's own under a memory alarm: publishes in flight when
// the alarm begins are never confirmed, Publish returns them Unanswered,
// and Close -- as the relay calls it after any unanswered publish, as the
// consumer's session calls it when it ends -- waits for the alarm's end.
func TestCloseIsBoundedDuringAMemoryAlarm(t *testing.T) {
	mq, err := sandbox.StartRabbitCluster(1, 2*time.Minute)
	if mq != nil {
		t.Cleanup(mq.Remove)
	}
	if err != nil && strings.Contains(err.Error(), "not installed") {
		t.Skip(err)
	}
	require.NoError(t, err)
	node := mq.Nodes[0]
	ctl := func(args ...string) {
		t.Helper()
		out, err := exec.Command("rabbitmqctl", append([]string{"-q", "-n", node.Name}, args...)...).CombinedOutput()
		require.NoError(t, err, "%s", out)
	}
	t.Cleanup(func() {
		_ = exec.Command("rabbitmqctl", "-q", "-n", node.Name, "set_vm_memory_high_watermark", "0.4").Run()
	})

	q := "idem.test.alarm"
	// Whether Close hangs depends on a broker frame arriving within
	// CloseDeadline's first 2 s (then the heartbeater moves the deadline
	// 30 s on, and the broker's heartbeats keep moving it): try a few
	// rounds, each a publisher caught by an alarm.
	for round := range 4 {
		conn, _, err := broker.Dial([]string{node.URL()}, 0, amqp.Config{}) // DefaultHeartbeat, as the relay and the DLQ tools dial
		require.NoError(t, err)
		p, err := broker.NewPublisher(conn, broker.PublisherOptions{})
		require.NoError(t, err)
		require.NoError(t, p.Declare(func(ch *amqp.Channel) error {
			_, err := ch.QueueDeclare(q, true, false, false, false, nil)
			return err
		}))

		// Publish without pause until a publish goes unanswered.
		lost := make(chan broker.Result, 1)
		go func() {
			body := strings.Repeat("x", 4096)
			for {
				msgs := make([]broker.Message, 200)
				for i := range msgs {
					msgs[i] = msg(q, body)
				}
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
				rs := p.Publish(ctx, msgs...)
				cancel()
				for _, r := range rs {
					if r.Outcome == broker.Unanswered {
						lost <- r
						return
					}
				}
			}
		}()
		time.Sleep(500 * time.Millisecond)
		ctl("set_vm_memory_high_watermark", "0")
		var r broker.Result
		select {
		case r = <-lost:
		case <-time.After(30 * time.Second):
			t.Fatal("no publish went unanswered during the alarm")
		}
		why, _ := p.Blocked()

		closed := make(chan struct{})
		start := time.Now()
		go func() { _ = p.Close(); close(closed) }()
		select {
		case <-closed:
			t.Logf("round %d: unanswered (%v; blocked: %q); Close returned after %s", round, r.Err, why, time.Since(start).Round(time.Millisecond))
			ctl("set_vm_memory_high_watermark", "0.4")
			ctl("purge_queue", q)
			continue
		case <-time.After(broker.CloseTimeout + 3*broker.DefaultHeartbeat + 5*time.Second): // past even one read deadline the heartbeater sets
			t.Errorf("round %d: Close still waiting %s after it began (CloseTimeout %s), for as long as the alarm lasts",
				round, time.Since(start).Round(time.Second), broker.CloseTimeout)
			ctl("set_vm_memory_high_watermark", "0.4")
			<-closed
			t.Logf("Close returned once the alarm ended, %s after it began", time.Since(start).Round(time.Second))
		}
		return
	}
}
