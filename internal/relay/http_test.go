package relay

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
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
