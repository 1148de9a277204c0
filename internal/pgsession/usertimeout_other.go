//go:build !linux

package pgsession

import "time"

// setUserTimeout is a no-op where TCP_USER_TIMEOUT does not exist; the
// keepalives and the server-side timeouts still bound the link.
func setUserTimeout(uintptr, time.Duration) error { return nil }
