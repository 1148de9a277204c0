package e2e

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/outbox"
)

// TestAWebhookWithAWrongSecretPausesIdemRelay: `idem relay` sends 30 rows to
// an API that answers 401 (a wrong signing secret). On the main before the
// pause, every row was dead at its first attempt while the relay stayed
// ready. Now the destination pauses: /readyz is 503 naming it,
// idem_outbox_destination_paused is 1, `idem outbox list` shows the pause
// and its rows "pending (paused)", no row is dead; once the API takes the
// requests, the relay resumes by itself and sends every row once.
func TestAWebhookWithAWrongSecretPausesIdemRelay(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	var fixed atomic.Bool
	var acted sync.Map // Idempotency-Key -> times acted on
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !fixed.Load() {
			w.WriteHeader(http.StatusUnauthorized)
			fmt.Fprint(w, "bad signature")
			return
		}
		n, _ := acted.LoadOrStore(r.Header.Get("Idempotency-Key"), new(atomic.Int32))
		n.(*atomic.Int32).Add(1)
	}))
	t.Cleanup(srv.Close)

	g, err := guard.New(guard.Config{Scope: "payments", Store: pgtier.New(e.pool)})
	require.NoError(t, err)
	const rows = 30
	for i := range rows {
		id := fmt.Sprintf("evt_%02d", i)
		_, err = g.Process(context.Background(), guard.Event{ID: id, Hash: guard.HashFields(id)}, func(ctx context.Context, tx pgx.Tx) error {
			return outbox.Enqueue(ctx, tx, outbox.Message{EventID: id, To: "webhook", Key: id, Body: []byte(id)})
		})
		require.NoError(t, err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	e.vars = append(e.vars, "IDEM_OUTBOX_DESTINATIONS=webhook="+srv.URL, "IDEM_OUTBOX_POLL_INTERVAL=50ms",
		"IDEM_OUTBOX_MAX_ATTEMPTS=3", "IDEM_OUTBOX_BACKOFF_MIN=100ms", "IDEM_OUTBOX_BACKOFF_MAX=500ms", "IDEM_METRICS_ADDR="+addr)
	e.relay("relay")

	require.Eventually(t, func() bool {
		code, body := get(t, "http://"+addr+"/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(body, "destination webhook paused")
	}, 30*time.Second, 50*time.Millisecond, "the relay never said the destination paused")
	s, err := tryScrape(addr)
	require.NoError(t, err)
	require.Equal(t, 1.0, s.value("idem_outbox_destination_paused", "destination", "webhook"))

	r := e.run(nil, "outbox", "list")
	require.Equal(t, 0, r.code, r.out)
	require.Contains(t, r.out, "PAUSED")
	require.Contains(t, r.out, "http 401")
	require.Contains(t, r.out, "bad signature")
	require.Contains(t, r.out, "pending (paused)")
	time.Sleep(2 * time.Second) // several probes' worth
	require.Zero(t, e.outboxStates()["dead"], "no row is dead for the destination's fault")

	fixed.Store(true)
	require.Eventually(t, func() bool { return e.outboxStates()["sent"] == rows }, 30*time.Second, 50*time.Millisecond,
		"states: %v", e.outboxStates())
	require.Eventually(t, func() bool {
		code, _ := get(t, "http://"+addr+"/readyz")
		return code == http.StatusOK
	}, 30*time.Second, 50*time.Millisecond)
	n := 0
	acted.Range(func(_, v any) bool {
		require.EqualValues(t, 1, v.(*atomic.Int32).Load())
		n++
		return true
	})
	require.Equal(t, rows, n)
	r = e.run(nil, "outbox", "list")
	require.Equal(t, 0, r.code, r.out)
	require.NotContains(t, r.out, "PAUSED", "the resumed destination's pause is gone")
}
