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

// shardHistory is what the guard knows of one shard's history.
//
// last is the history the store last reported. It labels the leases the
// guard takes and lets the log say when the history changed; it never
// confirms a marker. Only a history read after the marker was read does:
// in the claim (processInStore), or in a read (confirm).
//
// Reads are shared. A caller joins the next read, which is sent once the
// one in flight (if any) has ended; every caller that joined before it was
// sent had read its markers before, so its answer confirms them all. Under
// load, a shard costs one read per read's duration, however many batches
// or single events wait for one.
type shardHistory struct {
	turn chan struct{} // held by the read in flight

	mu   sync.Mutex
	last tier.History
	next *historyRead // the read that callers join; nil: none waiting
}

// historyRead is one read of a store's history, and its answer.
type historyRead struct {
	done    chan struct{} // closed once h and err are set
	callers int           // callers that joined it, under shardHistory.mu
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

// read returns the store's history from a read sent after the call began.
// The caller that opens a read sends it, with a deadline of its own
// (historyTimeout: others wait on it), after the read in flight ends.
func (s *shardHistory) read(ctx context.Context, store Store) (tier.History, error) {
	s.mu.Lock()
	r, send := s.next, false
	if r == nil {
		r, send = &historyRead{done: make(chan struct{})}, true
		s.next = r
	}
	r.callers++
	s.mu.Unlock()
	if send {
		s.turn <- struct{}{} // the read in flight ends within historyTimeout
		s.mu.Lock()
		s.next = nil // from here on, a caller may have read its markers after this read is sent
		s.mu.Unlock()
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), historyTimeout)
		r.h, r.err = store.History(rctx)
		cancel()
		<-s.turn
		close(r.done)
	}
	select {
	case <-r.done:
		return r.h, r.err
	case <-ctx.Done():
		return "", ctx.Err()
	}
}
