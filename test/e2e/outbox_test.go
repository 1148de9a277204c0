package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/crashpoint"
	"github.com/idemhq/idem/internal/fleet"
	"github.com/idemhq/idem/internal/step"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/outbox"
)

// api is an HTTP destination that records every request by its
// Idempotency-Key and acts on a key only the first time, as an API that
// honours the header does. fail, if set, answers instead for a request.
type api struct {
	mu    sync.Mutex
	seen  map[string]int
	acted map[string]string // key -> the body it acted on
	fail  func(n int) int   // n: the request's number; 0: answer normally
	n     int
	url   string
}

func newAPI(t *testing.T) *api {
	a := &api{seen: map[string]int{}, acted: map[string]string{}}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		key := r.Header.Get("Idempotency-Key")
		a.mu.Lock()
		defer a.mu.Unlock()
		a.n++
		if a.fail != nil {
			if code := a.fail(a.n); code != 0 {
				w.WriteHeader(code)
				return
			}
		}
		a.seen[key]++
		if _, done := a.acted[key]; !done {
			a.acted[key] = string(body)
		}
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(srv.Close)
	a.url = srv.URL
	return a
}

// counts returns how many keys were seen, and how many were seen more than
// once.
func (a *api) counts() (keys, repeated int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, n := range a.seen {
		if n > 1 {
			repeated++
		}
	}
	return len(a.seen), repeated
}

// relay starts `idem relay` (the harness's, when a crash point is armed).
func (e *env) relay(name string, extraEnv ...string) *fleet.Proc {
	e.t.Helper()
	vars := append(append([]string{}, e.vars...), extraEnv...)
	p, err := fleet.Start(fleet.Spec{Bin: binFor("relay", vars), Command: "relay", Name: name, Dir: e.dir, Env: vars})
	require.NoError(e.t, err)
	e.procs = append(e.procs, p)
	return p
}

// outboxStates counts idem_outbox rows by state.
func (e *env) outboxStates() map[string]int {
	rows, err := e.pool.Query(context.Background(), `SELECT state, count(*) FROM idem_outbox GROUP BY state`)
	require.NoError(e.t, err)
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (struct {
		s string
		n int
	}, error) {
		var v struct {
			s string
			n int
		}
		return v, r.Scan(&v.s, &v.n)
	})
	require.NoError(e.t, err)
	m := map[string]int{}
	for _, v := range out {
		m[v.s] = v.n
	}
	return m
}

// TestARelayKilledAtEachStepPublishesEveryMessage kills `idem relay` with
// SIGKILL after a pass published and before it marked the rows sent, and
// after the mark, then lets a healthy relay finish. Every message reaches
// the API; one killed before its mark is POSTed again with the same
// Idempotency-Key, which the API acts on once; one killed after its mark is
// not sent again.
func TestARelayKilledAtEachStepPublishesEveryMessage(t *testing.T) {
	for _, at := range step.Relay {
		t.Run(at, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, "", "")
			a := newAPI(t)
			g, err := guard.New(guard.Config{Scope: "pay", Store: pgtier.New(e.pool)})
			require.NoError(t, err)
			const n = 200
			for i := range n {
				id := fmt.Sprintf("e%03d", i)
				_, err := g.Process(context.Background(), guard.Event{ID: id, Hash: guard.HashFields(id)}, func(ctx context.Context, tx pgx.Tx) error {
					return outbox.Enqueue(ctx, tx, outbox.Message{EventID: id, To: "api", Key: fmt.Sprintf("u%d", i%7), Body: []byte(id)})
				})
				require.NoError(t, err)
			}
			e.vars = append(e.vars, "IDEM_OUTBOX_DESTINATIONS=api="+a.url, "IDEM_OUTBOX_BATCH_SIZE=10", "IDEM_OUTBOX_POLL_INTERVAL=50ms")
			victim := e.relay("victim", crashpoint.EnvAt+"="+at, crashpoint.EnvAfter+"=3")
			e.waitKilled(victim, at)
			before := e.outboxStates()
			e.relay("survivor")
			require.Eventually(t, func() bool { return e.outboxStates()["sent"] == n }, 60*time.Second, 50*time.Millisecond)

			keys, repeated := a.counts()
			require.Equal(t, n, keys, "every message reached the API")
			require.Len(t, a.acted, n, "and was acted on once")
			for i := range n {
				id := fmt.Sprintf("e%03d", i)
				require.Equal(t, id, a.acted[outbox.ID("pay", id, 0)])
			}
			if at == step.RelayPublished {
				require.Equal(t, 20, before["sent"], "two passes of 10 committed; the third was published, not marked")
				require.Positive(t, repeated, "the pass the victim published is published again, with the same key")
			} else {
				require.Equal(t, 30, before["sent"], "three passes of 10 committed")
				require.Zero(t, repeated, "a message marked sent is not sent again")
			}
		})
	}
}

// TestTwoHopsApplyEachPaymentAndEachReceiptOnce runs the reference
// pipeline: payments consumers send a RECEIPT_REQUESTED per payment through
// the outbox, relayed to the receipts stream; receipts consumers record one
// receipt each (the receipts table has no unique key) and POST it through
// the outbox to an API. Consumers and relays are killed along the way.
func TestTwoHopsApplyEachPaymentAndEachReceiptOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	a := newAPI(t)
	a.fail = func(n int) int { // the API fails now and then
		if n%17 == 0 {
			return http.StatusServiceUnavailable
		}
		return 0
	}
	receipts := testenv.Queue(t, e.amqpURL)
	e.vars = append(e.vars,
		"IDEM_OUTBOX_DESTINATIONS=receipts=queue:"+receipts+" mailer="+a.url,
		"IDEM_OUTBOX_POLL_INTERVAL=100ms", "IDEM_OUTBOX_BACKOFF_MIN=20ms", "IDEM_OUTBOX_BACKOFF_MAX=200ms")
	receiptsEnv := []string{"IDEM_HANDLER=receipts", "IDEM_SCOPE=receipts", "IDEM_QUEUE=" + receipts, "IDEM_OUTBOX_EMIT=mailer"}
	// The first receipts consumer declares the receipts stream before the
	// first receipt is relayed; it dies after a few.
	r := e.consume("receipts-victim", append(receiptsEnv, crashpoint.EnvAt+"="+step.Committed, crashpoint.EnvAfter+"=5")...)
	e.waitConsuming(r)
	m := e.publish(600, 0.25)
	payments := []string{"IDEM_OUTBOX_EMIT=receipts"}
	kill := func(p *fleet.Proc, at string) { e.waitKilled(p, at) }
	kill(e.consume("payments-victim", append(payments, crashpoint.EnvAt+"="+step.Committed, crashpoint.EnvAfter+"=150")...), step.Committed)
	kill(e.relay("relay-victim", "IDEM_OUTBOX_BATCH_SIZE=20", crashpoint.EnvAt+"="+step.RelayPublished, crashpoint.EnvAfter+"=3"), step.RelayPublished)
	kill(r, step.Committed)
	for i := range 2 {
		e.consume(fmt.Sprintf("payments-%d", i), append(payments, "IDEM_OUTBOX_RELAY=true")...)
		e.consume(fmt.Sprintf("receipts-%d", i), receiptsEnv...)
	}
	e.waitApplied(m)

	var got, distinct int
	require.Eventually(t, func() bool {
		require.NoError(t, e.pool.QueryRow(context.Background(),
			`SELECT count(*), count(DISTINCT payment_id) FROM receipts`).Scan(&got, &distinct))
		keys, _ := a.counts()
		return distinct == len(m.Events) && keys == len(m.Events)
	}, 90*time.Second, 100*time.Millisecond, "receipts %d of %d", distinct, len(m.Events))
	require.Equal(t, distinct, got, "no payment has two receipts")
	require.Len(t, a.acted, len(m.Events), "the API acted once per receipt")
	for _, body := range a.acted {
		require.True(t, strings.Contains(body, `"paymentId"`), body)
	}
	e.stopAll()
	e.requireExactlyOnce(m)
	require.Zero(t, e.outboxStates()["dead"])
}

// TestOutboxToolsShowAndReplayDeadRows: a message the API refuses for good
// is dead with its reason in `idem outbox list --dead` and `idem inspect`;
// once the API accepts it, `idem outbox replay` sends it, with its ID.
func TestOutboxToolsShowAndReplayDeadRows(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	a := newAPI(t)
	var mu sync.Mutex
	refuse := true
	a.fail = func(int) int {
		mu.Lock()
		defer mu.Unlock()
		if refuse {
			return http.StatusUnprocessableEntity
		}
		return 0
	}
	g, err := guard.New(guard.Config{Scope: "payments", Store: pgtier.New(e.pool)})
	require.NoError(t, err)
	_, err = g.Process(context.Background(), guard.Event{ID: "evt_out", Hash: guard.HashFields("evt_out")}, func(ctx context.Context, tx pgx.Tx) error {
		return outbox.Enqueue(ctx, tx, outbox.Message{EventID: "evt_out", To: "api", Key: "user_1", Body: []byte(`{}`)})
	})
	require.NoError(t, err)
	e.vars = append(e.vars, "IDEM_OUTBOX_DESTINATIONS=api="+a.url, "IDEM_OUTBOX_POLL_INTERVAL=50ms")
	e.relay("relay")
	require.Eventually(t, func() bool { return e.outboxStates()["dead"] == 1 }, 30*time.Second, 20*time.Millisecond)

	id := outbox.ID("payments", "evt_out", 0)
	out, err := e.idem("outbox", "list", "--dead")
	require.NoError(t, err, out)
	require.Contains(t, out, id)
	require.Contains(t, out, "http 422")
	out, err = e.idem("inspect", "evt_out")
	require.NoError(t, err, out)
	require.Contains(t, out, "DEAD after 1 attempt(s): http 422")

	mu.Lock()
	refuse = false
	mu.Unlock()
	out, err = e.idem("outbox", "replay", "--all-dead")
	require.NoError(t, err, out)
	require.Contains(t, out, "1 dead row(s) pending again")
	require.Eventually(t, func() bool { return e.outboxStates()["sent"] == 1 }, 30*time.Second, 20*time.Millisecond)
	require.Len(t, a.acted, 1)
	require.Contains(t, a.acted, id, "replayed with its own message ID")
	out, err = e.idem("inspect", "evt_out")
	require.NoError(t, err, out)
	require.Contains(t, out, "to api, key \"user_1\": sent ")
}
