package chaos

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/loadgen"
	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/pkg/outbox"
)

// The second hop of a --two-hop run: every payment sends a RECEIPT_REQUESTED
// through the payments consumers' outbox to the receipts stream; a fleet of
// receipts consumers records each in receipts and POSTs it, through their
// own outbox, to an API the run serves. Every consumer of both fleets also
// runs a relay (outbox.relay), so killing a consumer kills a relay.

// Scopes of the two hops, as the message IDs derive from them.
const (
	paymentsScope = "payments"
	receiptsScope = "receipts"
)

// api is the HTTP destination of the second hop. It records every request
// by its Idempotency-Key and acts on a key the first time only, as an API
// that honours the key does; during an http-fail fault it answers 503,
// during http-401 401, and during http-slow it answers after slow (past the relays' publish
// timeout, so that they give up on requests it acts on).
type api struct {
	srv  *http.Server
	url  string
	slow time.Duration

	mu      sync.Mutex
	seen    map[string]int
	failing int // the status it answers instead of acting; 0: none
	slowing bool
}

func startAPI(slow time.Duration) (*api, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	a := &api{url: "http://" + ln.Addr().String() + "/receipts", slow: slow, seen: map[string]int{}}
	a.srv = &http.Server{Handler: a, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = a.srv.Serve(ln) }()
	return a, nil
}

func (a *api) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	key := r.Header.Get("Idempotency-Key")
	a.mu.Lock()
	failing, slowing := a.failing, a.slowing
	if failing == 0 && key != "" {
		a.seen[key]++ // acted on the first time; every later time only answered
	}
	a.mu.Unlock()
	switch {
	case failing != 0:
		w.WriteHeader(failing)
	case slowing:
		time.Sleep(a.slow)
	}
}

func (a *api) set(failing int, slowing bool) {
	a.mu.Lock()
	a.failing, a.slowing = failing, slowing
	a.mu.Unlock()
}

func (a *api) keys() map[string]int {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make(map[string]int, len(a.seen))
	for k, v := range a.seen {
		out[k] = v
	}
	return out
}

func (a *api) close() { _ = a.srv.Close() }

// SecondHop is the verdict's second hop: receipts and the API's requests.
type SecondHop struct {
	Receipts        int `json:"receipts"`        // rows in receipts
	Distinct        int `json:"distinct"`        // payments with a receipt
	Doubled         int `json:"doubled"`         // payments with more than one receipt
	Missing         int `json:"missing"`         // applied payments without a receipt
	Phantom         int `json:"phantom"`         // receipts for payments that were never applied
	WrongID         int `json:"wrongId"`         // receipts whose event ID is not their payment's message ID
	APIKeys         int `json:"apiKeys"`         // Idempotency-Keys the API acted on
	APIRepeats      int `json:"apiRepeats"`      // keys it was sent more than once (and acted on once)
	APIMissing      int `json:"apiMissing"`      // receipts whose POST never arrived
	APIPhantom      int `json:"apiPhantom"`      // keys that are no receipt's
	OutboxPending   int `json:"outboxPending"`   // rows never sent
	OutboxDead      int `json:"outboxDead"`      // rows that failed for good
	LeftInQueue     int `json:"leftInQueue"`     // receipts stream, at the end
	DeadLetterQueue int `json:"deadLetterQueue"` // receipts stream's DLQ

	missing []string // the payments counted in Missing
}

// receiptsTopology is the receipts stream: partitioned like the payments
// stream.
func (r *run) receiptsTopology() broker.Topology {
	t := broker.TopologyFor(r.queue+".receipts", 0)
	t.Partitions = max(1, r.o.Partitions)
	return t
}

// hopEnv is what the two-hop run adds to the env of a consumer that
// reaches the services at e.
func (r *run) hopEnv(e endpoints) []string {
	t := r.receiptsTopology()
	return []string{
		"IDEM_OUTBOX_EMIT=receipts",
		"IDEM_OUTBOX_RELAY=true",
		fmt.Sprintf("IDEM_OUTBOX_DESTINATIONS=receipts=queue:%s/%d mailer=%s", t.Queue, t.Partitions, e.api),
		"IDEM_OUTBOX_POLL_INTERVAL=200ms",
		"IDEM_OUTBOX_BACKOFF_MIN=100ms",
		"IDEM_OUTBOX_BACKOFF_MAX=2s",
		"IDEM_OUTBOX_MAX_ATTEMPTS=200",
		"IDEM_OUTBOX_PUBLISH_TIMEOUT=1s",
	}
}

// hopSize is the receipts fleet's size.
func (r *run) hopSize() int { return max(1, r.o.Consumers/2) }

// paymentsEnv is the env of the payments consumer in slot: through the
// slot's links.
func (r *run) paymentsEnv(slot int) []string {
	e := r.links[slot].at
	if !r.o.TwoHop {
		return r.consumerEnv(e)
	}
	return append(r.consumerEnv(e), r.hopEnv(e)...)
}

// receiptsEnv is the env of the receipts consumer in slot: through the
// links of the run's slot o.Consumers+slot.
func (r *run) receiptsEnv(slot int) []string {
	e := r.links[r.o.Consumers+slot].at
	return append(append(r.consumerEnv(e), r.hopEnv(e)...),
		"IDEM_HANDLER=receipts",
		"IDEM_SCOPE="+receiptsScope,
		"IDEM_QUEUE="+r.receiptsTopology().Queue,
		"IDEM_OUTBOX_EMIT=mailer",
	)
}

// secondHop checks the second hop against the manifest.
func (r *run) secondHop(ctx context.Context, m loadgen.Manifest) (SecondHop, error) {
	var h SecondHop
	rows := map[string][]string{} // payment -> receipt event IDs
	for _, pool := range r.pools {
		if err := readReceipts(ctx, pool, rows); err != nil {
			return h, err
		}
		var pending, dead int
		if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE state = 'pending'), count(*) FILTER (WHERE state = 'dead') FROM idem_outbox`).Scan(&pending, &dead); err != nil {
			return h, err
		}
		h.OutboxPending += pending
		h.OutboxDead += dead
	}
	keys := r.api.keys()
	published := make(map[string]bool, len(m.Events))
	for _, ev := range m.Events {
		published[ev.EventID] = true
	}
	want := map[string]bool{} // the API keys receipts should have sent
	for payment, ids := range rows {
		h.Receipts += len(ids)
		h.Distinct++
		if len(ids) > 1 {
			h.Doubled++
		}
		if !published[payment] {
			h.Phantom++
		}
		for _, id := range ids {
			if id != outbox.ID(paymentsScope, payment, 0) {
				h.WrongID++
			}
			want[outbox.ID(receiptsScope, id, 0)] = true
		}
	}
	for payment := range published {
		if _, ok := rows[payment]; !ok {
			h.Missing++
			h.missing = append(h.missing, payment)
		}
	}
	for k := range want {
		if keys[k] == 0 {
			h.APIMissing++
		}
	}
	for k, n := range keys {
		h.APIKeys++
		if n > 1 {
			h.APIRepeats++
		}
		if !want[k] {
			h.APIPhantom++
		}
	}
	return h, nil
}

func readReceipts(ctx context.Context, pool *pgxpool.Pool, into map[string][]string) error {
	rs, err := pool.Query(ctx, `SELECT payment_id, event_id FROM receipts`)
	if err != nil {
		return err
	}
	defer rs.Close()
	for rs.Next() {
		var payment, id string
		if err := rs.Scan(&payment, &id); err != nil {
			return err
		}
		into[payment] = append(into[payment], id)
	}
	return rs.Err()
}

// hopSettled reports whether the second hop has caught up: every applied
// payment has its receipt (but those in forgive, see forgiven), the API has
// every receipt's key, and no outbox row is pending.
func (r *run) hopSettled(ctx context.Context, m loadgen.Manifest, forgive map[string]bool) bool {
	h, err := r.secondHop(ctx, m)
	if err != nil || h.APIMissing > 0 || h.OutboxPending > 0 {
		return false
	}
	for _, id := range h.missing {
		if !forgive[id] {
			return false
		}
	}
	return true
}

// judgeHop adds the second hop's problems.
func (res *Result) judgeHop(add func(cond bool, format string, args ...any)) {
	h := res.Hop
	if h == nil {
		return
	}
	add(h.Doubled > 0, "%d payments have more than one receipt", h.Doubled)
	add(h.Missing > 0, "%d payments have no receipt", h.Missing)
	add(h.Phantom > 0, "%d receipts for payments never published", h.Phantom)
	add(h.WrongID > 0, "%d receipts whose event ID is not their payment's message ID", h.WrongID)
	add(h.APIMissing > 0, "%d receipts never reached the API", h.APIMissing)
	add(h.APIPhantom > 0, "%d API keys belong to no receipt", h.APIPhantom)
	add(h.OutboxPending > 0, "%d outbox rows never sent", h.OutboxPending)
	add(h.OutboxDead > 0, "%d outbox rows dead", h.OutboxDead)
	add(h.LeftInQueue > 0, "%d messages stuck in the receipts stream", h.LeftInQueue)
	add(h.DeadLetterQueue > 0, "%d messages in the receipts stream's dead-letter queue", h.DeadLetterQueue)
}

// printHop adds the second hop's rows to the verdict table.
func (res *Result) printHop(t *table) {
	h := res.Hop
	if h == nil {
		return
	}
	t.head("SECOND HOP (payment → outbox → receipts → outbox → API)")
	t.row("receipts consumers: applied", res.HopOutcomes["processed"])
	t.row("receipts consumers: duplicates dropped", res.HopOutcomes["duplicate_redis"]+res.HopOutcomes["duplicate_postgres"]+res.HopOutcomes["duplicate_batch"])
	t.row("relays: sent / retried / dead", fmt.Sprintf("%d / %d / %d", res.RelayOutcomes["outbox/sent"], res.RelayOutcomes["outbox/retry"], res.RelayOutcomes["outbox/dead"]))
	t.row("relays: destination pauses", res.RelayOutcomes["outbox/paused"])
	t.row("receipts", h.Receipts)
	t.row("payments with a receipt", h.Distinct)
	t.row("payments with two or more", h.Doubled)
	t.row("payments without one", h.Missing)
	t.row("receipts for no payment", h.Phantom)
	t.row("API keys acted on (once each)", h.APIKeys)
	t.row("API keys sent again (same key)", h.APIRepeats)
	t.row("receipts the API never got", h.APIMissing)
	t.row("outbox rows pending / dead", fmt.Sprintf("%d / %d", h.OutboxPending, h.OutboxDead))
	t.row("receipts stream left / DLQ", fmt.Sprintf("%d / %d", h.LeftInQueue, h.DeadLetterQueue))
}

// judgeSecondHop fills in res's second hop, once both fleets stopped.
func (r *run) judgeSecondHop(ctx context.Context, m loadgen.Manifest, res *Result) error {
	h, err := r.secondHop(ctx, m)
	if err != nil {
		return err
	}
	t := r.receiptsTopology()
	for _, q := range t.Queues() {
		n, err := r.queueDepth(q)
		if err != nil {
			return err
		}
		h.LeftInQueue += n
	}
	if h.DeadLetterQueue, err = r.queueDepth(t.DeadLetterQueue); err != nil {
		return err
	}
	res.Hop = &h
	res.HopOutcomes = sumStats(r.hop.Procs())
	res.RelayOutcomes = map[string]int64{}
	for _, st := range []map[string]int64{res.Outcomes, res.HopOutcomes} {
		for k, v := range st {
			if strings.HasPrefix(k, "outbox/") {
				res.RelayOutcomes[k] += v
			}
		}
	}
	return nil
}

// deleteQueue is the queue-delete fault: it deletes a receipts partition
// queue with the messages in it (its consumers' links silenced for a moment
// before, so that it holds some), waits up to wait for the receipts
// consumers to declare it again (it declares it itself after that), and
// then resends, as `idem outbox resend --destination receipts` would, every
// receipts row sent since the run began: the messages the queue held are
// among them, and the receipts consumers drop the ones they already took.
func (r *run) deleteQueue(ctx context.Context, wait time.Duration) (string, error) {
	const silence = 1500 * time.Millisecond
	t := r.receiptsTopology()
	q := t.PartitionQueue(r.deletes % t.Partitions)
	r.deletes++
	conn, err := amqp.Dial(r.publishURL())
	if err != nil {
		return "", err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return "", err
	}
	// A queue its consumers keep empty loses little: the receipts
	// consumers' broker links go silent for a while first, so that it holds
	// the messages they cannot take or ack, and are closed once it is gone.
	var silenced []*sandbox.Link
	defer func() {
		for _, l := range silenced {
			_ = l.Heal()
		}
	}()
	for s := range r.hopSize() {
		for _, l := range r.links[r.o.Consumers+s].amqp {
			if err := l.Blackhole(); err != nil {
				return "", err
			}
			silenced = append(silenced, l)
		}
	}
	select {
	case <-ctx.Done():
		return "", ctx.Err() // the run is over: nothing deleted
	case <-time.After(silence):
	}
	if _, err := ch.QueueDelete(q, false, false, false); err != nil {
		return "", fmt.Errorf("delete %s: %w", q, err)
	}
	// The queue is gone: whatever fails from here, it is declared again
	// and its rows resent, or the run would blame idem for the fault's
	// own loss.
	var errs []error
	for _, l := range silenced {
		errs = append(errs, l.Heal())
	}
	silenced = nil
	by := "the receipts consumers"
	start := time.Now()
	for back := false; !back; {
		// A passive declare of a missing queue closes its channel.
		probe, err := conn.Channel()
		if err == nil {
			_, err = probe.QueueDeclarePassive(q, true, false, false, false, nil)
			_ = probe.Close()
		}
		switch {
		case err == nil:
			back = true
		case time.Since(start) > wait || ctx.Err() != nil || conn.IsClosed():
			by, back = "the run", true
			if derr := sandbox.DeclareTopology(r.publishURL(), t); derr != nil {
				errs = append(errs, fmt.Errorf("declare %s again: %w", q, derr))
			}
		default:
			time.Sleep(50 * time.Millisecond)
		}
	}
	took := time.Since(start).Round(10 * time.Millisecond)
	var resent int64
	rctx := context.WithoutCancel(ctx)
	for _, pool := range r.pools {
		// Another fault may have the database down at this moment (a
		// pg-restart): the resend is tried again, as an operator would,
		// for up to resendFor. Resending a row twice only sends its
		// receipt again, which the receipts consumers drop.
		n, err := resendReceipts(rctx, pool, r.t0)
		errs = append(errs, err)
		resent += n
	}
	back := took
	return fmt.Sprintf("deleted %s after its consumers' broker links were silent for %s; declared again by %s after %s; resent the %d receipts rows sent since the run began",
		q, silence, by, back, resent), errors.Join(errs...)
}

// resendFor bounds how long deleteQueue tries its resend again while the
// database does not answer: longer than any fault that takes it down.
const resendFor = 60 * time.Second

// resendReceipts resends the receipts rows sent since t0 in pool's
// database, trying again every half second for up to resendFor.
func resendReceipts(ctx context.Context, pool *pgxpool.Pool, t0 time.Time) (int64, error) {
	deadline := time.Now().Add(resendFor)
	for {
		n, err := relay.Resend(ctx, pool, relay.Filter{Destination: "receipts"}, relay.Since{At: t0}, false)
		if err == nil || time.Now().After(deadline) {
			return n, err
		}
		time.Sleep(500 * time.Millisecond)
	}
}
