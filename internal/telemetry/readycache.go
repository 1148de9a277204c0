package telemetry

import (
	"bytes"
	"context"
	"net/http"
	"sync"
	"time"
)

// ReadyMaxAge is how long a /readyz answer is served again before its
// checks run anew: a probe storm costs one run of the checks (pings of
// every pool and Redis, a count of dead outbox rows) per second.
const ReadyMaxAge = time.Second

// ReadyCache serves the answer of H, a /readyz handler, to every request
// for MaxAge: requests that arrive while H runs wait for that run rather
// than starting another. H must bound its own checks (the request it gets
// outlives its caller's cancellation, since others wait on it).
type ReadyCache struct {
	H      http.Handler
	MaxAge time.Duration
	// Now is the clock; nil means time.Now.
	Now func() time.Time

	mu     sync.Mutex
	last   *readyRun // the newest finished run, nil before the first
	flight *readyRun // the run in progress, nil when none is
}

// readyRun is one run of H: done is closed once code, header and body hold
// its answer.
type readyRun struct {
	done   chan struct{}
	at     time.Time
	code   int
	header http.Header
	body   bytes.Buffer
}

// CacheReady wraps the /readyz handler h in a ReadyCache of ReadyMaxAge.
func CacheReady(h http.Handler) *ReadyCache {
	return &ReadyCache{H: h, MaxAge: ReadyMaxAge}
}

// ServeHTTP answers with the newest run of H younger than MaxAge, the run
// in flight, or a new run.
func (c *ReadyCache) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	run, lead := c.join()
	if lead {
		c.run(run, r)
	}
	select {
	case <-run.done:
	case <-r.Context().Done():
		return // the caller left
	}
	for k, v := range run.header {
		w.Header()[k] = v
	}
	w.WriteHeader(run.code)
	_, _ = w.Write(run.body.Bytes())
}

// run runs H into run and publishes it, even should H panic, so that no
// waiter waits forever.
func (c *ReadyCache) run(run *readyRun, r *http.Request) {
	finished := false
	defer func() {
		switch {
		case !finished: // H panicked: not ready, whatever it wrote
			run.code, run.header = http.StatusInternalServerError, http.Header{}
			run.body.Reset()
			run.body.WriteString("not ready\nthe readiness checks panicked\n")
		case run.code == 0:
			run.code = http.StatusOK
		}
		c.mu.Lock()
		run.at = c.now()
		c.last, c.flight = run, nil
		c.mu.Unlock()
		close(run.done)
	}()
	c.H.ServeHTTP(&recorder{run: run}, r.WithContext(context.WithoutCancel(r.Context())))
	finished = true
}

// join returns the run to answer with, and whether the caller must run it.
func (c *ReadyCache) join() (run *readyRun, lead bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.last != nil && c.now().Sub(c.last.at) < c.MaxAge {
		return c.last, false
	}
	if c.flight != nil {
		return c.flight, false
	}
	c.flight = &readyRun{done: make(chan struct{}), header: http.Header{}}
	return c.flight, true
}

func (c *ReadyCache) now() time.Time {
	if c.Now != nil {
		return c.Now()
	}
	return time.Now()
}

// recorder records H's answer into a run.
type recorder struct{ run *readyRun }

func (r *recorder) Header() http.Header { return r.run.header }

func (r *recorder) WriteHeader(code int) {
	if r.run.code == 0 {
		r.run.code = code
	}
}

func (r *recorder) Write(p []byte) (int, error) {
	r.WriteHeader(http.StatusOK)
	return r.run.body.Write(p)
}
