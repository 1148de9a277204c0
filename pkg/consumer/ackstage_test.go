package consumer

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
)

// ackRig is a worker whose acks go to a fakeBroker, with a confirm shard
// whose ack stage runs until the shard's acks are closed.
func ackRig(t *testing.T, n int) (*worker[string], *confirmShard[string], *fakeBroker, *settledCount, <-chan struct{}) {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), "postgres://127.0.0.1:1/none") // lazy: never dialled
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	g, err := guard.New(guard.Config{Scope: "svc", Store: pgtier.New(pool)})
	require.NoError(t, err)
	cfg := Config{URL: "amqp://", Queue: "q"}
	cfg.setDefaults()
	seen := &settledCount{}
	cfg.Observer = seen
	log := slog.New(slog.DiscardHandler)
	cfg.Logger = log
	b := newBroker(n)
	w := &worker[string]{
		c:     &shared[string]{cfg: cfg, guard: g, kill: newKillSwitch(cfg.KillSwitch, log, nopObserver{})},
		acker: newAcker(b, n),
	}
	for tag := uint64(1); tag <= uint64(n); tag++ {
		w.acker.register(tag)
	}
	c := newConfirmShard[string]()
	done := make(chan struct{})
	go func() { defer close(done); w.ackStage(context.Background(), c) }()
	return w, c, b, seen, done
}

type settledCount struct {
	nopObserver
	mu sync.Mutex
	n  map[string]int
}

func (s *settledCount) Settled(_ context.Context, st Settlement) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.n == nil {
		s.n = map[string]int{}
	}
	s.n[st.Message.ID]++
}

func dupItem(tag uint64) item[string] {
	return item[string]{d: amqp.Delivery{DeliveryTag: tag, MessageId: fmt.Sprint(tag)}, ev: guard.Event{ID: "evt"}}
}

// The ack stage acks every duplicate the confirm stage hands it exactly
// once, in whatever runs they come, and has sent them all when it returns
// (the session's teardown waits for it before the channel closes).
func TestTheAckStageAcksEveryDuplicateOnceBeforeItReturns(t *testing.T) {
	const n = 500
	w, c, b, seen, done := ackRig(t, n)
	tags := rand.Perm(n)
	for len(tags) > 0 {
		k := min(len(tags), 1+rand.IntN(20))
		var batch []item[string]
		for _, i := range tags[:k] {
			batch = append(batch, dupItem(uint64(i+1)))
		}
		b.intend(tagsOf(batch)...)
		c.acks.add(batch...)
		tags = tags[k:]
	}
	c.acks.close()
	<-done
	w.acker.flush()
	b.mu.Lock()
	defer b.mu.Unlock()
	require.NoError(t, b.violation)
	require.Empty(t, b.unacked, "every duplicate acked by the time the stage returned")
	require.Len(t, seen.n, n)
	for tag, k := range seen.n {
		require.Equal(t, 1, k, "tag %s settled once", tag)
	}
}

// A run of batches handed over while the ack stage is busy goes in one
// call, so in one multiple-ack: the acks of the duplicates one history read
// confirmed do not cost a frame each.
func TestDuplicatesHandedOverTogetherGoInOneFrame(t *testing.T) {
	const n = 64
	_, c, b, _, done := ackRig(t, n)
	var all []item[string]
	for tag := uint64(1); tag <= n; tag++ {
		all = append(all, dupItem(tag))
	}
	b.intend(tagsOf(all)...)
	c.acks.add(all...)
	c.acks.close()
	<-done
	b.mu.Lock()
	defer b.mu.Unlock()
	require.NoError(t, b.violation)
	require.Empty(t, b.unacked)
	require.Equal(t, 1, b.frames, "64 duplicates handed over together, one multiple-ack")
}

func tagsOf(items []item[string]) []uint64 {
	out := make([]uint64, len(items))
	for i, it := range items {
		out[i] = it.d.DeliveryTag
	}
	return out
}
