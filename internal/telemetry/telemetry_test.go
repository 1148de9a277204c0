package telemetry

import (
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestTheServerBoundsEveryClient(t *testing.T) {
	t.Parallel()
	srv := NewServer(http.NotFoundHandler())
	require.Equal(t, ReadHeaderTimeout, srv.ReadHeaderTimeout)
	require.Equal(t, ReadTimeout, srv.ReadTimeout)
	require.Equal(t, WriteTimeout, srv.WriteTimeout)
	require.Equal(t, IdleTimeout, srv.IdleTimeout)
	for _, d := range []any{srv.ReadHeaderTimeout, srv.ReadTimeout, srv.WriteTimeout, srv.IdleTimeout} {
		require.NotZero(t, d)
	}
}

func TestAReadyCacheOutlivesAPanickingCheck(t *testing.T) {
	t.Parallel()
	runs := 0
	c := CacheReady(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
		runs++
		panic(http.ErrAbortHandler)
	}))
	now := time.Unix(1_000_000, 0)
	c.Now = func() time.Time { return now }
	require.Panics(t, func() {
		c.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/readyz", nil))
	})
	rec := httptest.NewRecorder()
	c.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
	require.Equal(t, http.StatusInternalServerError, rec.Code, "a run that panicked is not ready, and does not wedge the cache")
	require.Equal(t, 1, runs)
}
