package broker

import (
	"bytes"
	"io"
	"net"
	"testing"

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

	w.cork()
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
	w.cork()
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
