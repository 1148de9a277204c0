package replication

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"
)

// Every is how often a Watcher reads the state again.
const Every = 30 * time.Second

// readTimeout bounds one shard's reading.
const readTimeout = 5 * time.Second

// Watcher reads the replication state of each shard's database at start
// and every Every, keeps the last reading for /readyz and the metrics, and
// logs each shard's verdict when it changes: a warning when an acked event
// can be lost on failover.
type Watcher struct {
	dbs []Querier // by shard
	log *slog.Logger

	mu   sync.Mutex
	last []reading // by shard
}

// reading is one shard's last reading.
type reading struct {
	done bool // read at least once
	st   State
	err  error
	said string // what the log last said of the shard
}

// NewWatcher watches dbs, one per shard, and logs to log.
func NewWatcher(dbs []Querier, log *slog.Logger) *Watcher {
	return &Watcher{dbs: dbs, log: log, last: make([]reading, len(dbs))}
}

// Run reads every shard at once, then every every, until ctx ends.
func (w *Watcher) Run(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		w.Read(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Read reads every shard once, now.
func (w *Watcher) Read(ctx context.Context) {
	var wg sync.WaitGroup
	for i, db := range w.dbs {
		wg.Go(func() {
			rctx, cancel := context.WithTimeout(ctx, readTimeout)
			st, err := Read(rctx, db)
			cancel()
			if ctx.Err() != nil {
				return // shutting down: keep the last reading, say nothing
			}
			w.record(ctx, i, st, err)
		})
	}
	wg.Wait()
}

// record keeps shard's reading and logs its verdict if it changed.
func (w *Watcher) record(ctx context.Context, shard int, st State, err error) {
	w.mu.Lock()
	r := &w.last[shard]
	r.done, r.st, r.err = true, st, err
	ok, text := st.Verdict()
	say := text
	if err != nil {
		say = err.Error()
	}
	changed := say != r.said
	r.said = say
	w.mu.Unlock()
	if !changed {
		return
	}
	log := w.log
	if len(w.dbs) > 1 {
		log = log.With("shard", shard)
	}
	switch {
	case err != nil:
		log.WarnContext(ctx, "postgres replication state unread: whether an acked event survives a failover is unknown", "err", err)
	case !ok:
		log.WarnContext(ctx, "postgres replication: "+text, "standbys", len(st.Standbys), "synchronous", st.Synchronous(),
			"synchronous_standby_names", st.SyncNames, "synchronous_commit", st.SyncCommit)
	default:
		log.InfoContext(ctx, "postgres replication: "+text, "standbys", len(st.Standbys), "synchronous", st.Synchronous())
	}
}

// Check is the /readyz line's verdict: nil when every shard's last reading
// says an acked event survives a failover, and detail says what each read;
// otherwise an error that says why not (or that a shard was not read).
func (w *Watcher) Check() (detail string, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	var oks, bad []string
	for i, r := range w.last {
		prefix := ""
		if len(w.last) > 1 {
			prefix = fmt.Sprintf("shard %d: ", i)
		}
		switch {
		case !r.done:
			bad = append(bad, prefix+"not read yet")
		case r.err != nil:
			bad = append(bad, prefix+r.err.Error())
		default:
			if ok, text := r.st.Verdict(); ok {
				oks = append(oks, prefix+text)
			} else {
				bad = append(bad, prefix+text)
			}
		}
	}
	if len(bad) > 0 {
		return "", errors.New(strings.Join(bad, "; "))
	}
	return strings.Join(oks, "; "), nil
}

// states returns each shard's last reading; ok[i] is false for a shard not
// read, or whose last reading failed.
func (w *Watcher) states() (sts []State, ok []bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, r := range w.last {
		sts, ok = append(sts, r.st), append(ok, r.done && r.err == nil)
	}
	return sts, ok
}
