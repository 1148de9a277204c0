// Package sandbox runs service instances of idem's own, on their own ports,
// so that chaos runs and tests can kill, pause, slow, flush and restart them
// without touching the shared services; and it closes RabbitMQ connections
// by their client-provided names. Every function returns an error rather than
// failing a test: `idem-lab chaos` and `idem-lab lab` use it as well as the tests
// (through internal/testenv).
package sandbox

import (
	"fmt"
	"net"
	"net/url"
)

// FreePort returns a loopback TCP port that was free a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("sandbox: free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// WithParam returns rawURL with query parameter k set to v, e.g. a
// DATABASE_URL's search_path or application_name.
func WithParam(rawURL, k, v string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return rawURL
	}
	q := u.Query()
	q.Set(k, v)
	u.RawQuery = q.Encode()
	return u.String()
}
