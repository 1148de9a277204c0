package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/redact"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/outbox"
)

// rowState reads the one idem_outbox row of a test's schema.
func rowState(t *testing.T, db *pgxpool.Pool) (state string, attempts int, lastErr string) {
	t.Helper()
	require.NoError(t, db.QueryRow(context.Background(),
		`SELECT state, attempts, coalesce(last_error, '') FROM idem_outbox`).Scan(&state, &attempts, &lastErr))
	return state, attempts, lastErr
}

// TestAHungRequestHookHoldsRunNoLongerThanItsBound: Run returns within
// PublishTimeout and a second of its context's end, as it promises (and
// Service.Run waits for it after the consumer's drain), even while a
// request hook hangs ignoring req.Context() (a signer waiting on a key
// service with a context of its own): the relay stops waiting for it.
func TestAHungRequestHookHoldsRunNoLongerThanItsBound(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Schema(t)
	srv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer srv.Close()
	enqueue(t, db, "api", 1)
	entered := make(chan struct{}, 1)
	release := make(chan struct{})
	defer close(release)
	const publishTimeout = 500 * time.Millisecond
	r, err := outbox.NewRelay(outbox.RelayConfig{
		Databases: []*pgxpool.Pool{db},
		Destinations: map[string]outbox.Destination{"api": {URL: srv.URL, Request: func(*http.Request) error {
			select {
			case entered <- struct{}{}:
			default:
			}
			<-release // a signer waiting on a key service that does not answer
			return nil
		}}},
		PollInterval:   20 * time.Millisecond,
		PublishTimeout: publishTimeout,
		Logger:         slog.New(slog.DiscardHandler),
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("the hook was never called")
	}
	cancel()
	began := time.Now()
	bound := publishTimeout + time.Second
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(bound + 3*time.Second):
		t.Fatalf("Run did not return %s after its context ended (its bound: PublishTimeout and a second, %s)", time.Since(began).Round(time.Millisecond), bound)
	}
	state, attempts, _ := rowState(t, db)
	require.Equal(t, "pending", state)
	require.Zero(t, attempts, "a request never sent spent an attempt")
}

// TestACredentialTheHookSetsIsMaskedWhereTheAPIQuotesIt: a hook that sets
// the credential itself (an OAuth token it fetches and refreshes) has it
// masked as Header's values are: an API that quotes the token it refuses
// puts it neither in the row's last_error, nor in the relay's log, nor in
// Ready() (/readyz). Ready names the last refusal on every read once
// the relay has sent nothing for three passes, the empty passes between
// them included.
func TestACredentialTheHookSetsIsMaskedWhereTheAPIQuotesIt(t *testing.T) {
	t.Parallel()
	const token = "ya29.Zq7sentinelOAUTHtoken"
	db, _ := testenv.Schema(t)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintf(w, "upstream busy for %s, retry", r.Header.Get("Authorization"))
	}))
	defer srv.Close()
	enqueue(t, db, "api", 1)
	logs := &testenv.LogBuffer{}
	r, err := outbox.NewRelay(outbox.RelayConfig{
		Databases: []*pgxpool.Pool{db},
		Destinations: map[string]outbox.Destination{"api": {URL: srv.URL, Request: func(req *http.Request) error {
			req.Header.Set("Authorization", "Bearer "+token) // from the token source
			return nil
		}}},
		PollInterval: 20 * time.Millisecond, BackoffMin: 10 * time.Millisecond, BackoffMax: 20 * time.Millisecond,
		MaxAttempts: 100,
		Logger:      slog.New(slog.NewTextHandler(logs, nil)),
	})
	require.NoError(t, err)
	runRelay(t, r)
	const refused = "http 503: upstream busy for " + redact.Mask + ", retry"
	require.Eventually(t, func() bool {
		err := r.Ready()
		return err != nil && strings.Contains(err.Error(), "sent nothing")
	}, 30*time.Second, 10*time.Millisecond, "the relay never said it sends nothing")
	require.Never(t, func() bool {
		if err := r.Ready(); err == nil || !strings.Contains(err.Error(), "(the last: "+refused+")") {
			t.Logf("Ready: %v", err)
			return true
		}
		return false
	}, 500*time.Millisecond, 5*time.Millisecond, "Ready lost the last refusal")
	_, _, lastErr := rowState(t, db)
	require.Equal(t, refused, lastErr)
	for where, text := range map[string]string{"idem_outbox.last_error": lastErr, "the relay's log": logs.String(), "Ready() (/readyz)": r.Ready().Error()} {
		require.NotContains(t, text, token, "the token is in %s", where)
	}
	require.Contains(t, logs.String(), refused)
}

// TestARequestHookThatFailsSpendsNoAttemptAndIsReported: only the
// destination's answer spends an attempt. A hook that fails (its signing
// key out of reach) or never returns (PublishTimeout) sends nothing: the
// row stays pending with its attempts, however long it lasts, later than
// MaxAttempts passes; the relay logs why and Ready says so, the hook's
// error masked of the header values it set; and once the hook works the
// row is sent and the relay is ready.
func TestARequestHookThatFailsSpendsNoAttemptAndIsReported(t *testing.T) {
	t.Parallel()
	const token = "Zq7sentinelSIGNINGtoken"
	for _, tc := range []struct {
		name string
		hook func(req *http.Request, release <-chan struct{}) error
		want string
	}{
		{"an error", func(req *http.Request, _ <-chan struct{}) error {
			req.Header.Set("X-Signer-Token", token)
			return errors.New("kms: sign with " + token + ": dial tcp 10.0.0.7:443: connect: connection refused")
		}, "the request hook: kms: sign with " + redact.Mask + ": dial tcp 10.0.0.7:443: connect: connection refused"},
		{"no return", func(_ *http.Request, release <-chan struct{}) error {
			<-release // ignoring req.Context()
			return nil
		}, "the request hook: did not return within 200ms"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db, _ := testenv.Schema(t)
			var sent atomic.Int32
			srv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { sent.Add(1) }))
			defer srv.Close()
			enqueue(t, db, "api", 1)
			release := make(chan struct{})
			defer close(release)
			var calls atomic.Int32
			var works atomic.Bool
			logs := &testenv.LogBuffer{}
			const maxAttempts = 3
			r, err := outbox.NewRelay(outbox.RelayConfig{
				Databases: []*pgxpool.Pool{db},
				Destinations: map[string]outbox.Destination{"api": {URL: srv.URL, Request: func(req *http.Request) error {
					calls.Add(1)
					if works.Load() {
						return nil
					}
					return tc.hook(req, release)
				}}},
				PollInterval: 20 * time.Millisecond, BackoffMin: 10 * time.Millisecond, BackoffMax: 20 * time.Millisecond,
				PublishTimeout: 200 * time.Millisecond, MaxAttempts: maxAttempts,
				Logger: slog.New(slog.NewTextHandler(logs, nil)),
			})
			require.NoError(t, err)
			runRelay(t, r)
			require.Eventually(t, func() bool {
				state, _, _ := rowState(t, db)
				return calls.Load() > 2*maxAttempts || state == "dead"
			}, 30*time.Second, 10*time.Millisecond, "the hook was not called again")
			state, attempts, lastErr := rowState(t, db)
			require.Equal(t, "pending", state, "dead though the destination never answered: %s", lastErr)
			require.Zero(t, attempts)
			require.Zero(t, sent.Load(), "a request whose hook failed was sent")
			require.Eventually(t, func() bool { err := r.Ready(); return err != nil && strings.Contains(err.Error(), tc.want) },
				10*time.Second, 10*time.Millisecond, "Ready never named the hook's failure")
			require.ErrorContains(t, r.Ready(), `http: destination api: `+tc.want)
			require.ErrorContains(t, r.Ready(), `; 1 request(s) not sent, no attempt spent`)
			require.Contains(t, logs.String(), "relay pass failed")
			require.Contains(t, logs.String(), tc.want)
			require.NotContains(t, logs.String(), token)

			works.Store(true)
			require.Eventually(t, func() bool { state, _, _ := rowState(t, db); return state == "sent" && r.Ready() == nil },
				30*time.Second, 10*time.Millisecond, "the row was not sent once the hook worked, or the relay stayed not ready")
			_, attempts, _ = rowState(t, db)
			require.Equal(t, 1, attempts, "only the request the API answered counts")
			require.EqualValues(t, 1, sent.Load())
		})
	}
}
