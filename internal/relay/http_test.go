package relay

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
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

// TestAnAnswerQuotingTheURLsCredentialsIsMasked: an API that quotes the
// request back in its error (the URL's ?access_token=…, the user name that
// holds a token, the Authorization net/http made of it) reaches the row's
// last_error and the relay's log with none of them.
func TestAnAnswerQuotingTheURLsCredentialsIsMasked(t *testing.T) {
	const token, user = "Zq7sentinelTOKEN", "Zq7sentinelUSER"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		name, _, _ := r.BasicAuth()
		w.WriteHeader(http.StatusUnauthorized)
		fmt.Fprintf(w, "%s %s: no key %s, token %s (%s)", r.Method, r.URL.RequestURI(), name, r.URL.Query().Get("access_token"), r.Header.Get("Authorization"))
	}))
	defer srv.Close()
	u := strings.Replace(srv.URL, "://", "://"+user+"@", 1) + "/v1/pay?region=eu&access_token=" + token
	res := newHTTPSender(5*time.Second, 0).send(context.Background(), Destination{Kind: HTTP, URL: u}, &row{scope: "pay", eventID: "e1", ctype: "application/json"})
	require.Error(t, res.err)
	require.False(t, res.final, "a 401 is tried again by default")
	require.Equal(t, "http 401", res.class, "and counts towards a pause")
	msg := res.err.Error()
	require.NotContains(t, msg, token)
	require.NotContains(t, msg, user)
	require.NotContains(t, msg, base64.StdEncoding.EncodeToString([]byte(user+":")))
	require.Equal(t, "http 401: POST /v1/pay?region=eu&access_token="+redact.Mask+": no key "+redact.Mask+", token "+redact.Mask+" ("+redact.Mask+")", msg)
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

// TestARequestHooksErrorIsHeldBackAndQuotesNoHeader: the hook sees the
// request with every header set (to sign it); its error is no answer of
// the destination's: the row is skipped, its attempt not spent, and the
// error, held for the pass to report, quotes none of the destination's
// header values nor those the hook set, even where the hook's does.
func TestARequestHooksErrorIsHeldBackAndQuotesNoHeader(t *testing.T) {
	const secret, signer = "Zq7sentinelTOKEN", "Zq7sentinelSIGNER"
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
				r.Header.Set("X-Signer", signer)
				return errors.New("signing key not loaded yet for " + r.Header.Get("Authorization") + " by " + signer)
			}
			r.Header.Set("X-Signature", "sig:"+r.Header.Get("Idempotency-Key"))
			return nil
		}}
	s := newHTTPSender(5*time.Second, 0)
	w := &row{scope: "pay", eventID: "e1", ctype: "application/json"}
	res := s.send(context.Background(), d, w)
	require.False(t, res.sent)
	require.True(t, res.skipped, "a hook's error spends no attempt")
	require.NoError(t, res.err)
	require.EqualError(t, res.held, "the request hook: signing key not loaded yet for "+redact.Mask+" by "+redact.Mask)
	require.Zero(t, calls.Load(), "a request whose hook failed is not sent")

	fail = false
	res = s.send(context.Background(), d, w)
	require.True(t, res.sent, "%v", res.err)
	require.EqualValues(t, 1, calls.Load())
}

// TestAHeldBackRowSkipsTheRestOfItsKey: a row whose hook fails holds
// back the later rows of its key, so that none overtakes it, and the pass
// reports the hook's error once per destination with the rows it held.
func TestAHeldBackRowSkipsTheRestOfItsKey(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer srv.Close()
	dests := map[string]Destination{
		"signed": {Kind: HTTP, URL: srv.URL, Request: func(r *http.Request) error {
			if r.Header.Get("X-Idem-Event-Id") == "bad" {
				return errors.New("no key")
			}
			return nil
		}},
		"plain": {Kind: HTTP, URL: srv.URL},
	}
	rows := []*row{
		{destination: "signed", key: "k", eventID: "bad"},
		{destination: "signed", key: "k", eventID: "after"},
		{destination: "signed", key: "j", eventID: "other"},
		{destination: "plain", key: "k", eventID: "plain"},
	}
	results := make([]result, len(rows))
	err := newHTTPSender(5*time.Second, 0).sendAll(context.Background(), dests, rows, []int{0, 1, 2, 3}, results)
	require.EqualError(t, err, "http: destination signed: the request hook: no key; 1 request(s) not sent, no attempt spent")
	require.True(t, results[0].skipped)
	require.Error(t, results[0].held)
	require.Equal(t, result{skipped: true}, results[1], "it waits behind the row held back")
	require.True(t, results[2].sent, "%v", results[2].err)
	require.True(t, results[3].sent, "%v", results[3].err)
}

// TestAHungRequestHookIsLeftAtTheRequestsTimeout: a hook that ignores
// req.Context() holds its row no longer than the request's timeout, then
// is reported; when the pass's context ends first, the row is skipped
// without a word.
func TestAHungRequestHookIsLeftAtTheRequestsTimeout(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	d := Destination{Kind: HTTP, URL: "http://127.0.0.1:1/", Request: func(*http.Request) error { <-release; return nil }}
	w := &row{scope: "pay", eventID: "e1", ctype: "application/json"}
	res := newHTTPSender(50*time.Millisecond, 0).send(context.Background(), d, w)
	require.True(t, res.skipped)
	require.ErrorContains(t, res.held, "the request hook: did not return within 50ms")

	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(20*time.Millisecond, cancel)
	res = newHTTPSender(time.Hour, 0).send(ctx, d, w)
	require.Equal(t, result{skipped: true}, res)
}

// TestReservedHeaders: the headers idem or net/http sets, in any case,
// and every X-Idem- one; not the others.
func TestReservedHeaders(t *testing.T) {
	for _, h := range []string{"content-type", "Idempotency-Key", "X-Idem-Event-Id", "x-idem-type", "X-IDEM-Tenant", "Host", "content-length", "Transfer-Encoding", "Trailer", "Connection"} {
		require.True(t, ReservedHeader(h), h)
	}
	for _, h := range []string{"Authorization", "X-Api-Key", "X-Idem", "X-Idempotent", "User-Agent"} {
		require.False(t, ReservedHeader(h), h)
	}
}
