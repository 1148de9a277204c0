package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/redact"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/outbox"
)

// TestAnHTTPDestinationsHeaderComesFromTheEnvironment: with outbox.headers,
// `idem relay` sends an API that answers 401 without its bearer token the
// token read from the environment, and the message is delivered. The token
// is printed nowhere: not by `idem config` (which shows the header and its
// variable), not in the error a relay stores when the API's answer quotes
// it, not by `idem outbox list` (for an error stored before), not in the
// relay's log.
func TestAnHTTPDestinationsHeaderComesFromTheEnvironment(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	const secret = "Zq7sentinelHDR"
	const token = "Bearer " + secret
	var mu sync.Mutex
	acted := map[string]string{} // Idempotency-Key -> body
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if r.Header.Get("Authorization") != token {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		if r.Header.Get("X-Idem-Event-Id") == "evt_refused" {
			w.WriteHeader(http.StatusUnprocessableEntity)
			fmt.Fprintf(w, "refused for %s", r.Header.Get("Authorization")) // an answer that quotes the token
			return
		}
		mu.Lock()
		acted[r.Header.Get("Idempotency-Key")] = string(body)
		mu.Unlock()
	}))
	t.Cleanup(srv.Close)
	resp, err := http.Post(srv.URL, "application/json", strings.NewReader(`{}`))
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusUnauthorized, resp.StatusCode, "the API wants the token")

	g, err := guard.New(guard.Config{Scope: "payments", Store: pgtier.New(e.pool)})
	require.NoError(t, err)
	for _, id := range []string{"evt_ok", "evt_refused"} {
		_, err = g.Process(context.Background(), guard.Event{ID: id, Hash: guard.HashFields(id)}, func(ctx context.Context, tx pgx.Tx) error {
			return outbox.Enqueue(ctx, tx, outbox.Message{EventID: id, To: "api", Key: id, Body: []byte(`{"id":"` + id + `"}`)})
		})
		require.NoError(t, err)
	}
	// A dead row whose error quotes the token (stored before the relay
	// masked it, or by a request hook): the tools mask it.
	_, err = e.pool.Exec(context.Background(), `INSERT INTO idem_outbox (scope, event_id, idx, destination, lane, body, state, attempts, last_error)
		VALUES ('payments', 'evt_old', 0, 'api', 0, '', 'dead', 1, 'http 401: bad token `+secret+`')`)
	require.NoError(t, err)
	e.vars = append(e.vars, "IDEM_OUTBOX_DESTINATIONS=api="+srv.URL, "IDEM_OUTBOX_HEADERS=api:Authorization=env:E2E_API_AUTH",
		"E2E_API_AUTH="+token, "IDEM_OUTBOX_POLL_INTERVAL=50ms")

	r := e.run(nil, "config")
	require.Equal(t, 0, r.code, r.out)
	require.Contains(t, r.out, "api:Authorization=env:E2E_API_AUTH")
	require.NotContains(t, r.out, secret)

	relay := e.relay("relay")
	require.Eventually(t, func() bool {
		s := e.outboxStates()
		return s["sent"] == 1 && s["dead"] == 2
	}, 30*time.Second, 20*time.Millisecond)
	mu.Lock()
	require.Equal(t, map[string]string{outbox.ID("payments", "evt_ok", 0): `{"id":"evt_ok"}`}, acted, "delivered, with the token")
	mu.Unlock()
	var lastErr string
	require.NoError(t, e.pool.QueryRow(context.Background(), `SELECT last_error FROM idem_outbox WHERE event_id = 'evt_refused'`).Scan(&lastErr))
	require.Equal(t, "http 422: refused for "+redact.Mask, lastErr, "the stored error quotes no token")

	r = e.run(nil, "outbox", "list", "--dead")
	require.Equal(t, 0, r.code, r.out)
	require.Contains(t, r.out, "bad token "+redact.Mask)
	require.Contains(t, r.out, "refused for "+redact.Mask)
	require.NotContains(t, r.out, secret)

	require.NoError(t, relay.Stop(30*time.Second))
	log, err := os.ReadFile(relay.LogPath)
	require.NoError(t, err)
	require.Contains(t, string(log), "outbox message dead")
	require.NotContains(t, string(log), secret)
}
