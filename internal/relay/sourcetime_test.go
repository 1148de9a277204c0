package relay_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/outbox"
)

// TestARelayedMessageCarriesItsSourceEventsTime: the relay stamped a
// message with its row's commit time only, and the time of the event that
// sent it was lost. A message of a timed event carries that time, to the
// microsecond (PostgreSQL's precision), as x-idem-source-time on AMQP and X-Idem-Source-Time on
// HTTP; an untimed event's carries none.
func TestARelayedMessageCarriesItsSourceEventsTime(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Schema(t)
	top := declare(t, testenv.Queue(t, testenv.AMQPURL()), 1)
	var mu sync.Mutex
	got := map[string]string{} // event ID → X-Idem-Source-Time ("-" if absent)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		v := r.Header.Get("X-Idem-Source-Time")
		if _, ok := r.Header["X-Idem-Source-Time"]; !ok {
			v = "-"
		}
		mu.Lock()
		got[r.Header.Get("X-Idem-Event-Id")] = v
		mu.Unlock()
	}))
	t.Cleanup(srv.Close)
	g := newGuard(t, db)
	at := time.Date(2026, 11, 30, 16, 55, 14, 123456000, time.FixedZone("CET", 3600))
	for _, ev := range []guard.Event{
		{ID: "timed", Hash: guard.HashFields("timed"), Time: at},
		{ID: "untimed", Hash: guard.HashFields("untimed")},
	} {
		out, err := g.Process(context.Background(), ev, func(ctx context.Context, tx pgx.Tx) error {
			return outbox.Enqueue(ctx, tx,
				outbox.Message{EventID: ev.ID, To: "receipts", Body: []byte(ev.ID)},
				outbox.Message{EventID: ev.ID, Index: 1, To: "api", Body: []byte(ev.ID)})
		})
		require.NoError(t, err)
		require.Equal(t, guard.OutcomeProcessed, out)
	}
	run(t, relay.Config{DB: db, AMQPURLs: []string{testenv.AMQPURL()},
		Destinations: amqpDest(t, "receipts=queue:"+top.Queue+" api="+srv.URL)})

	want := "2026-11-30T15:55:14.123456Z"
	for _, d := range take(t, 2, top.Queues()...) {
		v, ok := d.Headers[relay.HeaderSourceTime]
		switch string(d.Body) {
		case "timed":
			require.Equal(t, want, v)
		case "untimed":
			require.False(t, ok, "an untimed event's message has no source time: %v", v)
		default:
			t.Fatalf("unexpected message %q", d.Body)
		}
	}
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(got) == 2 }, 10*time.Second, 20*time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, map[string]string{"timed": want, "untimed": "-"}, got)
}
