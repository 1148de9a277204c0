package relay_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/outbox"
)

// namedPool opens a pool on url whose sessions carry an application_name
// of the test's own, so that pg_stat_activity tells them apart from other
// tests', and trace their queries with tracer, if not nil.
func namedPool(t *testing.T, url string, tracer pgx.QueryTracer) (*pgxpool.Pool, string) {
	t.Helper()
	name := testenv.Name(t)
	pc, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	pc.ConnConfig.RuntimeParams["application_name"] = name
	pc.ConnConfig.Tracer = tracer
	pool, err := pgxpool.NewWithConfig(context.Background(), pc)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool, name
}

// claimsOpen counts the sessions named app that hold a pass's claimed rows:
// idle in a transaction whose last statement was the claim.
func claimsOpen(t *testing.T, db *pgxpool.Pool, app string) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
WHERE application_name = $1 AND state = 'idle in transaction' AND query LIKE 'WITH lanes AS%'`, app).Scan(&n))
	return n
}

// hangingAPI is an HTTP destination whose every request waits until the
// test ends or the request's own context does; it counts the requests.
func hangingAPI(t *testing.T) (*atomic.Int32, chan struct{}, string) {
	t.Helper()
	var arrived atomic.Int32
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived.Add(1)
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(srv.Close)
	return &arrived, release, srv.URL
}

// claimTracer counts a pool's claims: all, and those that returned rows.
type claimTracer struct{ all, withRows atomic.Int64 }

type claimKey struct{}

func (c *claimTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.HasPrefix(d.SQL, "WITH lanes AS") {
		c.all.Add(1)
		return context.WithValue(ctx, claimKey{}, true)
	}
	return ctx
}

func (c *claimTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	if ctx.Value(claimKey{}) != nil && d.Err == nil && d.CommandTag.RowsAffected() > 0 {
		c.withRows.Add(1)
	}
}

// TestWhileOnePassPublishesTheOtherClaimsAndWaitsItsTurn: a relay runs two
// passes at once. While one publishes (to an API that holds every request),
// the other claims its rows, but publishes nothing until the first is
// done: the destination sees one pass's requests at a time. As the first
// is slow, the second lets its rows go rather than hold them, and waits
// for its turn without claiming again.
func TestWhileOnePassPublishesTheOtherClaimsAndWaitsItsTurn(t *testing.T) {
	db, u := testenv.Schema(t)
	var claims claimTracer
	pool, app := namedPool(t, u, &claims)
	arrived, release, url := hangingAPI(t)
	released := false
	t.Cleanup(func() {
		if !released {
			close(release)
		}
	})
	g := newGuard(t, db)
	const n, batch = 64, 4
	for i := range n {
		id := fmt.Sprintf("e%02d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "api", Key: id, Body: []byte(id)})
	}
	run(t, relay.Config{DB: pool, BatchSize: batch, Retention: time.Hour, Destinations: amqpDest(t, "api="+url)})

	require.Eventually(t, func() bool { return claims.withRows.Load() == 2 }, 10*time.Second, 10*time.Millisecond,
		"the second pass claims its rows while the first publishes")
	// Past the second's wait for its turn, and the time for a second that
	// did not wait to be seen.
	time.Sleep(time.Second)
	got := arrived.Load()
	require.Positive(t, got)
	require.LessOrEqual(t, got, int32(batch), "only the first pass's rows are sent while it publishes")
	require.Equal(t, 1, claimsOpen(t, db, app), "the second pass let its rows go while the first is slow")
	require.EqualValues(t, 2, claims.withRows.Load(), "the second pass waits for its turn without claiming again")

	close(release)
	released = true
	require.Eventually(t, func() bool { return states(t, db)["sent"] == n }, 20*time.Second, 20*time.Millisecond)
}

// TestAPassWaitingItsTurnKeepsItsTransactionBound: no pass's transaction
// outlasts TxBound (the bound idem's pools give the server), however long
// the other pass publishes. Here the API never answers: the first pass
// publishes for its whole PublishTimeout, and the second, claimed
// meanwhile, lets its rows go and claims them again in its turn.
func TestAPassWaitingItsTurnKeepsItsTransactionBound(t *testing.T) {
	db, u := testenv.Schema(t)
	pool, app := namedPool(t, u, nil)
	_, release, url := hangingAPI(t)
	t.Cleanup(func() { close(release) })
	g := newGuard(t, db)
	for i := range 64 {
		id := fmt.Sprintf("e%02d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "api", Key: id, Body: []byte(id)})
	}
	cfg := relay.Config{DB: pool, BatchSize: 4, PublishTimeout: 2 * time.Second, MaxAttempts: 1000, Retention: time.Hour,
		Destinations: amqpDest(t, "api="+url)}
	run(t, cfg)

	require.Eventually(t, func() bool { return claimsOpen(t, db, app) == 2 }, 10*time.Second, 10*time.Millisecond)
	var longest time.Duration
	for end := time.Now().Add(6 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		var us int64
		require.NoError(t, db.QueryRow(context.Background(), `SELECT coalesce(max((extract(epoch FROM clock_timestamp() - xact_start) * 1e6)::bigint), 0)
FROM pg_stat_activity WHERE application_name = $1 AND xact_start IS NOT NULL`, app).Scan(&us))
		longest = max(longest, time.Duration(us)*time.Microsecond)
	}
	require.Greater(t, longest, cfg.PublishTimeout, "a pass held its rows while the API hung")
	require.Less(t, longest, cfg.TxBound()+500*time.Millisecond, "no pass's transaction outlasts TxBound")
}
