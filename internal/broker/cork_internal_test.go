package broker

import (
	"bytes"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestACorkedSocketWritesWhatItHeldInOrderAndBounded: writes made while
// corked reach the peer in order, once corkMax bytes are held or at
// uncork, and none before.
func TestACorkedSocketWritesWhatItHeldInOrderAndBounded(t *testing.T) {
	a, b := net.Pipe()
	defer b.Close()
	got := make(chan []byte, 1)
	go func() { all, _ := io.ReadAll(b); got <- all }()
	w := &writeBounded{Conn: a}

	w.cork(time.Time{})
	chunk := bytes.Repeat([]byte("x"), corkMax/3+1)
	var want []byte
	for i := range 2 {
		chunk[0] = byte('a' + i)
		n, err := w.Write(chunk)
		require.NoError(t, err)
		require.Equal(t, len(chunk), n)
		want = append(want, chunk...)
	}
	require.Zero(t, w.writes.Load(), "two thirds of corkMax are held")
	chunk[0] = 'c'
	_, err := w.Write(chunk)
	require.NoError(t, err)
	want = append(want, chunk...)
	require.EqualValues(t, 1, w.writes.Load(), "corkMax held: written")
	_, err = w.Write([]byte("tail"))
	require.NoError(t, err)
	want = append(want, "tail"...)
	require.EqualValues(t, 1, w.writes.Load())
	w.uncork()
	require.EqualValues(t, 2, w.writes.Load(), "the rest at uncork")
	_, err = w.Write([]byte("after"))
	require.NoError(t, err)
	want = append(want, "after"...)
	require.EqualValues(t, 3, w.writes.Load(), "uncorked: written at once")
	a.Close()
	require.Equal(t, want, <-got)
}

// TestAHeldWriteThatFailsClosesTheSocket: the library took held bytes as
// written, so a failure to write them closes the socket (the library's
// reader then fails, and it ends the connection with every publish it did
// not confirm), and every later write fails.
func TestAHeldWriteThatFailsClosesTheSocket(t *testing.T) {
	a, b := net.Pipe()
	w := &writeBounded{Conn: a}
	w.cork(time.Time{})
	n, err := w.Write([]byte("held"))
	require.NoError(t, err)
	require.Equal(t, 4, n)
	b.Close() // the peer is gone
	w.uncork()
	_, err = w.Write([]byte("next"))
	require.ErrorContains(t, err, "a corked write")
	_, err = a.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.ErrClosedPipe, "the socket is closed under the library's reader")
}

// TestAHeldWriteEndsByTheCorksDeadline: a peer that reads nothing (a
// broker under an alarm, a link gone silent) holds a write of held bytes
// until the deadline cork was given, not WriteTimeout; the socket is
// then closed, as for any failed held write. A write made after uncork
// has WriteTimeout again.
func TestAHeldWriteEndsByTheCorksDeadline(t *testing.T) {
	a, b := net.Pipe() // synchronous: a write waits for the peer's read
	defer b.Close()
	w := &writeBounded{Conn: a}
	const bound = 300 * time.Millisecond
	start := time.Now()
	w.cork(start.Add(bound))
	_, err := w.Write(bytes.Repeat([]byte("x"), corkMax)) // corkMax held: written, and nobody reads
	took := time.Since(start)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	require.GreaterOrEqual(t, took, bound)
	require.Less(t, took, WriteTimeout/2, "the held write waited past its cork's deadline")
	_, err = a.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.ErrClosedPipe, "the socket is closed under the library's reader")

	c, d := net.Pipe()
	defer d.Close()
	w = &writeBounded{Conn: c}
	w.cork(time.Now().Add(bound))
	_, err = w.Write([]byte("held"))
	require.NoError(t, err)
	go func() { _, _ = io.ReadFull(d, make([]byte, 4)) }()
	w.uncork()
	require.NoError(t, w.err, "read in time: written")
	require.True(t, w.until.IsZero(), "uncork drops the deadline")
	time.Sleep(bound)
	got := make(chan []byte, 1)
	go func() {
		time.Sleep(bound) // past the old cork's deadline
		buf := make([]byte, 5)
		_, _ = io.ReadFull(d, buf)
		got <- buf
	}()
	_, err = w.Write([]byte("after"))
	require.NoError(t, err, "an uncorked write is bounded by WriteTimeout only")
	require.Equal(t, "after", string(<-got))
}
