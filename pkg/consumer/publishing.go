package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/idemhq/idem/internal/broker"
)

// publishing is a session's publishing side, for dead letters: a connection
// of its own with a confirming publisher, opened, and opened again whenever
// it ends, on a goroutine of its own. The session consumes without it: only
// what needs a dead letter waits for it (sendLetter, bounded by StoreHold),
// so that a publishing connection that is lost, refused or silent never
// stops the events that need no publish.
type publishing struct {
	open    func(ctx context.Context) (*broker.Publisher, error)
	backoff Backoff
	log     *slog.Logger
	// changed is called whenever the publisher changes (a new one starts
	// unblocked); reopened whenever one opens after another ended, as a
	// session's reconnect counts (wire.CounterReconnect).
	changed, reopened func()

	mu      sync.Mutex
	pub     *broker.Publisher // nil while none is open
	why     error             // why none is open; nil before the first open ends
	changes chan struct{}     // closed, and replaced, whenever pub changes

	stop context.CancelFunc
	done chan struct{} // closed when run returns
}

// startPublishing opens publishers with open until close, the first at once.
// ctx bounds every open: once it ends, no new publisher is opened, and the
// one open stays until close.
func startPublishing(ctx context.Context, open func(context.Context) (*broker.Publisher, error), backoff Backoff, log *slog.Logger, changed, reopened func()) *publishing {
	ctx, stop := context.WithCancel(ctx)
	p := &publishing{open: open, backoff: backoff, log: log, changed: changed, reopened: reopened, changes: make(chan struct{}), stop: stop, done: make(chan struct{})}
	go func() { defer close(p.done); p.run(ctx) }()
	return p
}

// run keeps a publisher open until ctx ends.
func (p *publishing) run(ctx context.Context) {
	for attempt := 1; ; attempt++ {
		began := time.Now()
		pub, err := p.open(ctx)
		if ctx.Err() != nil {
			if pub != nil {
				p.set(pub, nil) // close closes it
			}
			return
		}
		if err == nil {
			if p.down() != nil {
				p.reopened()
			}
			p.set(pub, nil)
			select {
			case <-ctx.Done():
				return
			case <-pub.Done():
			}
			err = fmt.Errorf("publishing connection ended: %w", pub.Err())
			_ = pub.Close()
		}
		p.set(nil, err)
		if time.Since(began) > p.backoff.Max {
			attempt = 1 // it worked for a while: start over
		}
		delay := p.backoff.Delay(attempt)
		p.log.Warn("no publishing connection: dead letters wait, acks go on", "err", err, "attempt", attempt, "delay", delay)
		if !sleep(ctx, delay) {
			return
		}
	}
}

func (p *publishing) set(pub *broker.Publisher, why error) {
	p.mu.Lock()
	p.pub, p.why = pub, why
	close(p.changes)
	p.changes = make(chan struct{})
	p.mu.Unlock()
	if p.changed != nil {
		p.changed()
	}
}

// current returns the publisher open now (nil if none is, and why) and a
// channel closed when that changes.
func (p *publishing) current() (pub *broker.Publisher, changes <-chan struct{}, why error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pub == nil && p.why == nil {
		return nil, p.changes, errors.New("connecting")
	}
	return p.pub, p.changes, p.why
}

// down says why no publisher is open, once an open failed or one ended;
// nil while one is open, and while the first is being opened.
func (p *publishing) down() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.why
}

// close stops opening publishers and closes the one open.
func (p *publishing) close() {
	p.stop()
	<-p.done
	p.mu.Lock()
	pub := p.pub
	p.pub = nil
	p.mu.Unlock()
	if pub != nil {
		_ = pub.Close()
	}
}
