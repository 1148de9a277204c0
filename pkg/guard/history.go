package guard

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/idemhq/idem/internal/tier"
)

// historyTimeout bounds the query that reads a store's history to confirm
// done markers. A store that does not answer in time confirms nothing: the
// events go to the store, whose transaction has the caller's deadline and
// the consumer's hold.
const historyTimeout = 2 * time.Second

// historyGap is the least time between the sending of two history reads of
// one shard, unless historyEnough events were screened with a marker since
// the last. A read confirms
// every marker screened before it was sent, so under a stream of duplicates
// a shard costs at most one read per gap (500 a second) or per
// historyEnough duplicates, however many events and batches wait for one,
// and a duplicate waits at most the gap and one read for it.
const historyGap = 2 * time.Millisecond

// historyEnough is how many events screened with a done marker since the
// last read was sent send the next without waiting out historyGap (one read
// in flight at a time all the same): each needs a read sent after its
// screen, so it costs at most one round trip per historyEnough duplicates,
// and a stream of them waits for the reads alone, not for the gap. A
// consumer holds a duplicate until its marker is confirmed, so that wait
// bounds what a prefetch window of duplicates can do a second.
const historyEnough = 32

// shardHistory is what the guard knows of one shard's history.
//
// last is the history the store last reported. It labels the leases the
// guard takes and lets the log say when the history changed; it never
// confirms a marker. Only a history the store reported in a statement sent
// after the marker's batch was screened does: a claim's (processInStore) or
// a read's (confirm). Screening begins after the caller holds the
// deliveries, and a delivery that can find a marker the database lacks (a
// re-send after a restore or a failover) arrives after the database changed
// its history: any statement sent after screening began sees the new one.
//
// Reads are shared. A caller whose batch was screened at t takes the answer
// of the latest statement sent after t if one has answered; else it waits
// for the read in flight if that was sent after t; else it joins the next
// read, which is sent once the one in flight (if any) has ended and
// historyGap after the last was sent, or once historyEnough events were
// screened with a marker since. A claim sent after t answers for every caller of the next read
// (observe), which is then not sent.
type shardHistory struct {
	turn chan struct{} // held by the read in flight

	mu       sync.Mutex
	last     tier.History
	next     *historyRead // the read that callers join; nil: none waiting
	inFlight *historyRead // the read sent and not answered; nil: none
	answered *historyRead // the latest-sent statement that answered a history
	lastSent time.Time    // when the last read was sent
	// marked counts the events screened with a done marker since the last
	// read was sent (see historyEnough).
	marked int
}

// historyRead is one read of a store's history, and its answer.
type historyRead struct {
	done    chan struct{} // closed once h and err are set
	callers int           // callers that joined it, under shardHistory.mu
	enough  chan struct{} // closed once historyEnough marked events wait for it
	full    bool          // enough is closed, under shardHistory.mu
	after   time.Time     // the latest screening among its callers
	sent    time.Time     // when it was sent (at or before the statement left)
	h       tier.History
	err     error
}

func newShardHistories(n int) []*shardHistory {
	out := make([]*shardHistory, n)
	for i := range out {
		out[i] = &shardHistory{turn: make(chan struct{}, 1)}
	}
	return out
}

// known returns the history the store last reported; "" before any.
func (s *shardHistory) known() tier.History {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.last
}

// saw records that the store reported cur, and logs a change.
func (s *shardHistory) saw(ctx context.Context, log *slog.Logger, shard int, cur tier.History) {
	s.mu.Lock()
	prev := s.last
	s.last = cur
	s.mu.Unlock()
	if prev != "" && prev != cur {
		log.InfoContext(ctx, "the database's history changed (a failover, a restore, a restart, or a re-created database or dedup table): done markers written before it are not trusted, and their events go to the database",
			"shard", shard, "from", string(prev), "to", string(cur))
	}
}

// observe records that a statement sent at sent (a claim) reported h. It
// answers the next read, unsent, if every caller of it was screened before
// sent.
func (s *shardHistory) observe(sent time.Time, h tier.History) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.answered == nil || sent.After(s.answered.sent) {
		s.answered = &historyRead{sent: sent, h: h}
	}
	if r := s.next; r != nil && sent.After(r.after) {
		s.next = nil
		r.sent, r.h = sent, h
		close(r.done)
	}
}

// read returns the store's history from a read sent after the call began.
func (s *shardHistory) read(ctx context.Context, store Store) (tier.History, error) {
	return s.since(ctx, store, time.Now())
}

// screenedMarked records that n more events were screened with a done
// marker, each of which needs a read sent after its screen: the next read
// goes without waiting out the gap once historyEnough do.
func (s *shardHistory) screenedMarked(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.marked += n
	s.enoughLocked()
}

// enoughLocked closes the next read's enough if historyEnough events wait.
// Callers hold s.mu.
func (s *shardHistory) enoughLocked() {
	if r := s.next; r != nil && !r.full && s.marked >= historyEnough {
		r.full = true
		close(r.enough)
	}
}

// since returns the store's history from a statement sent after t: the
// latest such that answered, the read in flight if sent after t, or the
// next read. The caller that opens the next read has it sent, with a
// deadline of its own (historyTimeout: others wait on it).
func (s *shardHistory) since(ctx context.Context, store Store, t time.Time) (tier.History, error) {
	if err := ctx.Err(); err != nil {
		return "", err
	}
	s.mu.Lock()
	if a := s.answered; a != nil && a.sent.After(t) {
		s.mu.Unlock()
		return a.h, nil
	}
	r, send := s.inFlight, false
	if r == nil || !r.sent.After(t) {
		r = s.next
		if r == nil {
			r, send = &historyRead{done: make(chan struct{}), enough: make(chan struct{})}, true
			s.next = r
			s.enoughLocked()
		}
		r.callers++
		if t.After(r.after) {
			r.after = t
		}
	}
	s.mu.Unlock()
	if send {
		// Others may join it: it is sent whatever becomes of this caller,
		// which waits for it no longer than its ctx.
		go s.send(context.WithoutCancel(ctx), store, r)
	}
	select {
	case <-r.done:
		return r.h, r.err
	case <-ctx.Done():
		return "", ctx.Err()
	}
}

// send sends r once the read in flight ended and historyGap has passed
// since the last was sent, or historyEnough events wait for it, unless a
// claim answered it first.
func (s *shardHistory) send(ctx context.Context, store Store, r *historyRead) {
	s.turn <- struct{}{} // the read in flight ends within historyTimeout
	defer func() { <-s.turn }()
	s.mu.Lock()
	wait := time.Until(s.lastSent.Add(historyGap))
	s.mu.Unlock()
	if wait > 0 {
		gap := time.NewTimer(wait) // at most historyGap
		select {
		case <-gap.C:
		case <-r.enough:
			gap.Stop()
		}
	}
	s.mu.Lock()
	if s.next != r {
		s.mu.Unlock()
		return // a claim answered it (observe)
	}
	// From here on, a caller may have been screened after this read is
	// sent: it joins the next.
	s.next = nil
	r.sent = time.Now()
	s.lastSent, s.inFlight = r.sent, r
	s.marked = 0
	s.mu.Unlock()
	rctx, cancel := context.WithTimeout(ctx, historyTimeout)
	h, err := store.History(rctx)
	cancel()
	s.mu.Lock()
	r.h, r.err = h, err
	s.inFlight = nil
	if err == nil && (s.answered == nil || r.sent.After(s.answered.sent)) {
		s.answered = r
	}
	s.mu.Unlock()
	close(r.done)
}
