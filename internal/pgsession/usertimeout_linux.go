package pgsession

import (
	"syscall"
	"time"
)

// tcpUserTimeout is TCP_USER_TIMEOUT (linux/tcp.h), which package syscall
// does not name.
const tcpUserTimeout = 0x12

func setUserTimeout(fd uintptr, d time.Duration) error {
	return syscall.SetsockoptInt(int(fd), syscall.IPPROTO_TCP, tcpUserTimeout, int(d.Milliseconds()))
}
