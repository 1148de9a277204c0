package redistier_test

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/fastkey"
	"github.com/idemhq/idem/internal/redisfault"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/guardtest"
	"github.com/idemhq/idem/pkg/guard/redistier"
)

func newFilter(t *testing.T, rdb *redis.Client, cfg redistier.Config) *redistier.Filter {
	t.Helper()
	f, err := redistier.New(rdb, cfg)
	require.NoError(t, err)
	return f
}

func miniClient(t *testing.T) (*miniredis.Miniredis, *redis.Client) {
	t.Helper()
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr(), ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { rdb.Close() })
	return m, rdb
}

func TestFastPathSuiteMiniredis(t *testing.T) {
	guardtest.TestFastPath(t, func(t *testing.T) guard.FastPath {
		_, rdb := miniClient(t)
		// miniredis runs each EVAL in a fresh Lua state: slow under -race.
		return newFilter(t, rdb, redistier.Config{Timeout: time.Second})
	})
}

func TestFastPathSuiteRedis(t *testing.T) {
	guardtest.TestFastPath(t, func(t *testing.T) guard.FastPath {
		rdb, prefix := testenv.Redis(t)
		return newFilter(t, rdb, redistier.Config{Prefix: prefix, Timeout: time.Second})
	})
}

var e1 = guard.Event{ID: "evt_1", Hash: guard.HashFields("evt_1")}

func claim(f *redistier.Filter, ctx context.Context) tier.FastResult {
	return f.Claim(ctx, "svc", "", []guard.Event{e1})[0]
}

func TestLeaseExpiresSoACrashedClaimFreesItself(t *testing.T) {
	m, rdb := miniClient(t)
	f := newFilter(t, rdb, redistier.Config{Lease: 5 * time.Second})
	require.Equal(t, tier.FastAcquired, claim(f, context.Background()).State)
	require.Equal(t, tier.FastPending, claim(f, context.Background()).State)
	m.FastForward(5 * time.Second)
	require.Equal(t, tier.FastAcquired, claim(f, context.Background()).State)
}

func TestDoneMarkerExpiresAfterDoneTTL(t *testing.T) {
	m, rdb := miniClient(t)
	f := newFilter(t, rdb, redistier.Config{DoneTTL: time.Hour})
	require.NoError(t, f.MarkDone(context.Background(), "svc", "", []guard.Event{e1}))
	m.FastForward(59 * time.Minute)
	require.Equal(t, tier.FastDone, claim(f, context.Background()).State)
	m.FastForward(time.Minute)
	require.Equal(t, tier.FastAcquired, claim(f, context.Background()).State)
}

func TestFlushForgetsEverything(t *testing.T) {
	m, rdb := miniClient(t)
	f := newFilter(t, rdb, redistier.Config{})
	require.NoError(t, f.MarkDone(context.Background(), "svc", "", []guard.Event{e1}))
	m.FlushAll()
	// Not done any more: the guard must now ask Postgres, which still knows.
	require.Equal(t, tier.FastAcquired, claim(f, context.Background()).State)
}

// TestKeyLayout: a lease is pending:<history>:<token> and a done marker
// done:<history>:<hex hash>, each naming the history of the store it was
// written for.
func TestKeyLayout(t *testing.T) {
	m, rdb := miniClient(t)
	f := newFilter(t, rdb, redistier.Config{Prefix: "pay"})
	r := f.Claim(context.Background(), "svc", "0123456789ab", []guard.Event{e1})[0]
	v, err := m.Get("pay:svc:evt_1")
	require.NoError(t, err)
	require.Equal(t, "pending:"+r.Token, v)
	require.Regexp(t, `^pending:0123456789ab:[0-9a-z]+$`, v)
	require.NoError(t, f.MarkDone(context.Background(), "svc", "0123456789ab", []guard.Event{e1}))
	v, _ = m.Get("pay:svc:evt_1")
	require.Regexp(t, `^done:0123456789ab:[0-9a-f]{64}$`, v)
}

// TestMarkersOfAnEarlierVersionNameNoHistory: the values a version before
// histories wrote (done:<hash>, pending:<token>) read as they did, with no
// history, which confirms nothing: the guard sends such an event to the
// store, and its marker is then written again with the store's history.
func TestMarkersOfAnEarlierVersionNameNoHistory(t *testing.T) {
	m, rdb := miniClient(t)
	f := newFilter(t, rdb, redistier.Config{})
	hash := "4e1243bd22c66e76c2ba9eddc1f91394e57f9f83e7a3c5e9b0f0f2e7e3f5a1b2"
	m.Set("idem:svc:old_done", "done:"+hash)
	m.Set("idem:svc:old_lease", "pending:ghost")
	res := f.Claim(context.Background(), "svc", "0123456789ab", []guard.Event{
		{ID: "old_done", Hash: guard.HashFields("x")}, {ID: "old_lease", Hash: guard.HashFields("x")},
	})
	require.Equal(t, tier.FastDone, res[0].State)
	require.Equal(t, hash, hex.EncodeToString(res[0].Hash))
	require.Equal(t, tier.History(""), res[0].History)
	require.False(t, res[0].History.Confirms(""), "no history confirms nothing, not even no history")
	require.Equal(t, tier.FastPending, res[1].State)
}

func TestErrorsSkipAndOpenTheBreaker(t *testing.T) {
	m, rdb := miniClient(t)
	var mu sync.Mutex
	var transitions []string
	f := newFilter(t, rdb, redistier.Config{Breaker: redistier.BreakerConfig{
		FailureThreshold: 3,
		MinOutage:        time.Nanosecond, // trip on the count alone
		OpenTimeout:      time.Hour,
		OnStateChange: func(from, to string) {
			mu.Lock()
			transitions = append(transitions, from+"->"+to)
			mu.Unlock()
		},
	}})
	m.SetError("LOADING Redis is loading the dataset in memory")
	for range 3 {
		r := claim(f, context.Background())
		require.Equal(t, tier.FastSkipped, r.State)
		require.ErrorContains(t, r.Err, "LOADING")
	}
	require.Equal(t, "open", f.BreakerState())
	require.Equal(t, []string{"closed->open"}, transitions)

	// Open: no call reaches Redis at all, so an outage adds no latency.
	m.SetError("")
	before := m.CommandCount()
	r := claim(f, context.Background())
	require.Equal(t, tier.FastSkipped, r.State)
	require.ErrorIs(t, r.Err, gobreaker.ErrOpenState)
	require.Error(t, f.MarkDone(context.Background(), "svc", "", []guard.Event{e1}))
	require.Equal(t, before, m.CommandCount())
}

// blackhole accepts connections and never answers: a hung Redis.
func blackhole(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var conns []net.Conn
	var mu sync.Mutex
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
	})
	return l.Addr().String()
}

func TestHungRedisIsCutOffByTheCallDeadline(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: blackhole(t), ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { rdb.Close() })
	f := newFilter(t, rdb, redistier.Config{Timeout: 30 * time.Millisecond})
	r := claim(f, context.Background())
	require.Equal(t, tier.FastSkipped, r.State)
	require.True(t, errors.Is(r.Err, context.DeadlineExceeded) || isTimeout(r.Err), "want a deadline error, got %v", r.Err)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

func TestCallerCancellationNeverTripsTheBreaker(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: blackhole(t), ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { rdb.Close() })
	f := newFilter(t, rdb, redistier.Config{Timeout: time.Minute, Breaker: redistier.BreakerConfig{FailureThreshold: 1}})
	for range 5 {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
		r := claim(f, ctx)
		cancel()
		require.Equal(t, tier.FastSkipped, r.State)
	}
	require.Equal(t, "closed", f.BreakerState())
}

func TestNewRejectsUnsafeClientAndConfig(t *testing.T) {
	_, err := redistier.New(redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}), redistier.Config{})
	require.ErrorContains(t, err, "ContextTimeoutEnabled")
	_, rdb := miniClient(t)
	_, err = redistier.New(rdb, redistier.Config{Prefix: "a:b"})
	require.ErrorContains(t, err, "Prefix")
	_, err = redistier.New(rdb, redistier.Config{Lease: time.Microsecond})
	require.ErrorContains(t, err, "Lease")
}

func TestInspectReadsLeaseAndMarker(t *testing.T) {
	_, rdb := miniClient(t)
	f := newFilter(t, rdb, redistier.Config{Lease: 5 * time.Second, DoneTTL: time.Hour})
	ctx := context.Background()
	m, err := fastkey.Inspect(ctx, rdb, "idem", "svc", e1.ID)
	require.NoError(t, err)
	require.Equal(t, tier.FastSkipped, m.State, "no key")

	require.Equal(t, tier.FastAcquired, claim(f, ctx).State)
	m, err = fastkey.Inspect(ctx, rdb, "idem", "svc", e1.ID)
	require.NoError(t, err)
	require.Equal(t, tier.FastPending, m.State)
	require.InDelta(t, 5*time.Second, m.TTL, float64(time.Second))

	require.NoError(t, f.MarkDone(ctx, "svc", "0123456789ab", []guard.Event{e1}))
	m, err = fastkey.Inspect(ctx, rdb, "idem", "svc", e1.ID)
	require.NoError(t, err)
	require.Equal(t, tier.FastDone, m.State)
	require.Equal(t, e1.Hash, m.Hash)
	require.Equal(t, tier.History("0123456789ab"), m.History)
	require.InDelta(t, time.Hour, m.TTL, float64(time.Second))

	require.NoError(t, rdb.Set(ctx, fastkey.Key("idem", "svc", e1.ID), "garbage", 0).Err())
	_, err = fastkey.Inspect(ctx, rdb, "idem", "svc", e1.ID)
	require.ErrorContains(t, err, "unexpected value")
}

func TestErrorKinds(t *testing.T) {
	for _, c := range []struct {
		err  error
		kind string
	}{
		{gobreaker.ErrOpenState, redisfault.KindBreakerOpen},
		{context.DeadlineExceeded, redisfault.KindTimeout},
		{context.Canceled, redisfault.KindCanceled},
		{&net.OpError{Op: "dial", Err: errors.New("connection refused")}, redisfault.KindConnection},
		{redis.ErrClosed, redisfault.KindConnection},
		{errors.New("something else"), redisfault.KindOther},
	} {
		require.Equal(t, c.kind, redisfault.Kind(c.err), "%v", c.err)
	}
	// A reply error from a real server.
	_, rdb := miniClient(t)
	err := rdb.Do(context.Background(), "NOSUCHCOMMAND").Err()
	require.Error(t, err)
	require.Equal(t, redisfault.KindServer, redisfault.Kind(err))
}

// TestPartlyFailedClaimKeepsItsAnswersAndCountsAsAFailure: a pipeline whose
// commands fail on one node only (a dead cluster master) gives the other
// keys their answers, and counts against the breaker, so that a master that
// stays dead opens it. Here one key holds a value the tier cannot read.
func TestPartlyFailedClaimKeepsItsAnswersAndCountsAsAFailure(t *testing.T) {
	m, rdb := miniClient(t)
	f := newFilter(t, rdb, redistier.Config{Breaker: redistier.BreakerConfig{FailureThreshold: 2, MinOutage: time.Millisecond}})
	m.Set("idem:svc:bad", "garbage")
	bad := guard.Event{ID: "bad", Hash: guard.HashFields("bad")}
	for i := range 2 {
		good := guard.Event{ID: fmt.Sprintf("good_%d", i), Hash: guard.HashFields("good")}
		res := f.Claim(context.Background(), "svc", "", []guard.Event{good, bad})
		require.Equal(t, tier.FastAcquired, res[0].State, "the readable key keeps its lease")
		require.NotEmpty(t, res[0].Token)
		require.Equal(t, tier.FastSkipped, res[1].State)
		require.ErrorContains(t, res[1].Err, "unexpected value")
		time.Sleep(2 * time.Millisecond)
	}
	require.Equal(t, "open", f.BreakerState(), "two partly failed calls in a row open the breaker")
}
