package relay

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/redact"
)

// TestAnErrorAnswersBodyIsQuotedAsText: the error quotes the first 200
// bytes of the body, and the row's last_error (a text column) refuses
// invalid UTF-8 and NUL: a cut inside a character, or a NUL in the body,
// must not make the relay fail to record the failure.
func TestAnErrorAnswersBodyIsQuotedAsText(t *testing.T) {
	body := "bad\x00request " + strings.Repeat("a", 187) + "é and more" // 'é' spans bytes 200 and 201
	require.Equal(t, 201, strings.Index(body, " and more"))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusUnprocessableEntity)
		_, _ = w.Write([]byte(body))
	}))
	defer srv.Close()
	s := newHTTPSender(5*time.Second, 0)
	res := s.send(context.Background(), Destination{Kind: HTTP, URL: srv.URL}, &row{scope: "pay", eventID: "e1", ctype: "application/json"})
	require.Error(t, res.err)
	require.True(t, res.final)
	msg := res.err.Error()
	require.True(t, utf8.ValidString(msg), "%q", msg)
	require.NotContains(t, msg, "\x00")
	require.Equal(t, "http 422: badrequest "+strings.Repeat("a", 187), msg)
}

// TestAFailedRequestsErrorMasksTheURLsCredentials: net/http quotes the URL
// in its errors; the relay stores and logs them.
func TestAFailedRequestsErrorMasksTheURLsCredentials(t *testing.T) {
	const secret = "Zq7sentinelTOKEN"
	srv := httptest.NewServer(http.NotFoundHandler())
	srv.Close() // refuses connections
	d := Destination{Kind: HTTP, URL: srv.URL + "/v1/pay?region=eu&access_token=" + secret}
	res := newHTTPSender(5*time.Second, 0).send(context.Background(), d, &row{scope: "pay", eventID: "e1", ctype: "application/json"})
	require.Error(t, res.err)
	require.False(t, res.final, "a connection error is tried again")
	require.NotContains(t, res.err.Error(), secret)
	require.Contains(t, res.err.Error(), "/v1/pay?region=eu&access_token="+redact.Mask)
	require.NotContains(t, d.String(), secret)
	require.Contains(t, d.String(), "region=eu")
}

// TestAnHTTPDestinationsHeadersAreSentAndIdemsOwnWin: a destination's
// Header reaches the API on every request (a bearer token), alongside
// idem's headers, which it cannot replace: the Idempotency-Key is the
// message ID whatever the destination says.
func TestAnHTTPDestinationsHeadersAreSentAndIdemsOwnWin(t *testing.T) {
	got := make(chan http.Header, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- r.Header.Clone()
	}))
	defer srv.Close()
	d := Destination{Kind: HTTP, URL: srv.URL, Header: http.Header{
		"authorization":   {"Bearer s3cret"},
		"X-Api-Key":       {"k1", "k2"},
		"Idempotency-Key": {"mine"},
		"X-Idem-Event-Id": {"not-the-event"},
		"Content-Type":    {"text/plain"},
	}}
	w := &row{scope: "pay", eventID: "e1", idx: 2, typ: "PAID", ctype: "application/json"}
	res := newHTTPSender(5*time.Second, 0).send(context.Background(), d, w)
	require.True(t, res.sent, "%v", res.err)
	h := <-got
	require.Equal(t, "Bearer s3cret", h.Get("Authorization"))
	require.Equal(t, []string{"k1", "k2"}, h.Values("X-Api-Key"))
	require.Equal(t, []string{MessageID("pay", "e1", 2)}, h.Values("Idempotency-Key"))
	require.Equal(t, []string{"e1"}, h.Values("X-Idem-Event-Id"))
	require.Equal(t, []string{"application/json"}, h.Values("Content-Type"))
	require.Equal(t, []string{"PAID"}, h.Values("X-Idem-Type"))
	require.Equal(t, []string{"k1", "k2"}, d.Header["X-Api-Key"], "the destination's own header is left as it was")
}

// TestARequestHooksErrorIsRetriedAndQuotesNoHeader: the hook sees the
// request with every header set (to sign it); its error fails the attempt
// without making the row dead, and the error stored and logged quotes
// none of the destination's header values, even where the hook's does.
func TestARequestHooksErrorIsRetriedAndQuotesNoHeader(t *testing.T) {
	const secret = "Zq7sentinelTOKEN"
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		if r.Header.Get("X-Signature") != "sig:"+r.Header.Get("Idempotency-Key") {
			w.WriteHeader(http.StatusUnauthorized)
		}
	}))
	defer srv.Close()
	fail := true
	d := Destination{Kind: HTTP, URL: srv.URL, Header: http.Header{"Authorization": {"Bearer " + secret}},
		Request: func(r *http.Request) error {
			require.Equal(t, "Bearer "+secret, r.Header.Get("Authorization"))
			if fail {
				return errors.New("signing key not loaded yet for " + r.Header.Get("Authorization"))
			}
			r.Header.Set("X-Signature", "sig:"+r.Header.Get("Idempotency-Key"))
			return nil
		}}
	s := newHTTPSender(5*time.Second, 0)
	w := &row{scope: "pay", eventID: "e1", ctype: "application/json"}
	res := s.send(context.Background(), d, w)
	require.False(t, res.sent)
	require.False(t, res.final, "a hook's error is tried again")
	require.False(t, res.skipped, "a hook's error spends the attempt")
	require.ErrorContains(t, res.err, "signing key not loaded yet")
	require.NotContains(t, res.err.Error(), secret)
	require.Zero(t, calls.Load(), "a request whose hook failed is not sent")

	fail = false
	res = s.send(context.Background(), d, w)
	require.True(t, res.sent, "%v", res.err)
	require.EqualValues(t, 1, calls.Load())
}
