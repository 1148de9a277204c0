package lab

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/outbox"
)

// The downstream approaches: the payment's effect is guarded by idem in
// each, and each also sends a message to another service (a receipt
// request) on the pass's downstream queue. They differ in when: after the
// commit, before it, or through the outbox. The crash points are AfterCheck
// (before the commit: after the publish, for publish-before-commit) and
// AfterEffect (after the commit, before the publish or the ack).
//
// Every attempt carries a token of its own; the attempt that commits
// records it in lab_downstream in the payment's transaction. A message
// whose token was never recorded was sent by an attempt that rolled back: a
// phantom, a receipt for a payment that did not happen (yet, or ever).
var Downstream = []string{"publish-after-commit", "publish-before-commit", "outbox"}

// downstreamQueue is the pass's downstream queue.
func downstreamQueue(queue string) string { return queue + ".downstream" }

// labScope is the scope the downstream approaches guard and send in.
const labScope = "lab"

// sender publishes the downstream message of an attempt, with a confirm.
type sender struct {
	mu      sync.Mutex
	ch      *amqp.Channel
	queue   string
	returns chan amqp.Return
}

func newSender(conn *amqp.Connection, queue string) (*sender, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, err
	}
	if err := ch.Confirm(false); err != nil {
		return nil, err
	}
	return &sender{ch: ch, queue: queue, returns: ch.NotifyReturn(make(chan amqp.Return, 1))}, nil
}

func (s *sender) send(ctx context.Context, ev payments.Event, token string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	dc, err := s.ch.PublishWithDeferredConfirmWithContext(ctx, "", s.queue, true, false, amqp.Publishing{
		MessageId: outbox.ID(labScope, ev.EventID, 0), DeliveryMode: amqp.Persistent,
		Headers: amqp.Table{"x-lab-token": token, "x-lab-event": ev.EventID},
	})
	if err != nil {
		return err
	}
	ok, err := dc.WaitContext(ctx)
	switch {
	case err != nil:
		return err
	case !ok:
		return errors.New("downstream publish nacked")
	}
	select {
	case r := <-s.returns:
		return fmt.Errorf("downstream publish returned: %s", r.ReplyText)
	default:
	}
	return nil
}

func newToken() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// downstream is the three approaches, told apart by when.
type downstream struct {
	deps
	when   string // one of Downstream
	g      *guard.Guard
	sender *sender // nil for the outbox
}

func newDownstream(name string, d deps) (Approach, error) {
	g, err := guard.New(guard.Config{Scope: labScope, Store: pgtier.New(d.pool), Logger: d.log})
	if err != nil {
		return nil, err
	}
	a := &downstream{deps: d, when: name, g: g}
	if name == "outbox" {
		return a, nil
	}
	if a.sender, err = newSender(d.conn, downstreamQueue(d.queue)); err != nil {
		return nil, err
	}
	return a, nil
}

// recordToken marks the attempt's token as committed, in its transaction.
func recordToken(ctx context.Context, tx pgx.Tx, ev payments.Event, token string) error {
	_, err := tx.Exec(ctx, `INSERT INTO lab_downstream (event_id, token) VALUES ($1, $2)`, ev.EventID, token)
	return err
}

func (a *downstream) Handle(ctx context.Context, ev payments.Event) (string, error) {
	token := newToken()
	o, err := a.g.Process(ctx, guard.Event{ID: ev.EventID, Hash: ev.Hash()}, func(ctx context.Context, tx pgx.Tx) error {
		if err := (payments.Handler{}).Apply(ctx, tx, ev); err != nil {
			return err
		}
		if err := recordToken(ctx, tx, ev, token); err != nil {
			return err
		}
		switch a.when {
		case "publish-before-commit":
			if err := a.sender.send(ctx, ev, token); err != nil {
				return err
			}
		case "outbox":
			if err := outbox.Enqueue(ctx, tx, outbox.Message{EventID: ev.EventID, To: "downstream", Key: ev.UserID, Body: []byte(token)}); err != nil {
				return err
			}
		}
		a.crash(AfterCheck)
		return nil
	})
	switch {
	case err != nil:
		return "", err
	case o.IsDuplicate():
		return "duplicate", nil
	}
	a.crash(AfterEffect)
	if a.when == "publish-after-commit" {
		if err := a.sender.send(ctx, ev, token); err != nil {
			// The effect committed: a retry finds it a duplicate and
			// sends nothing. Publishing after the commit cannot take
			// this back.
			return "", err
		}
	}
	return "applied", nil
}

// runRelay runs the outbox approach's relay in the worker process until ctx
// ends: a worker that dies takes its relay with it.
func runRelay(ctx context.Context, d deps, amqpURL string) error {
	dests, err := relay.ParseDestinations("downstream=queue:" + downstreamQueue(d.queue))
	if err != nil {
		return err
	}
	r, err := relay.New(relay.Config{DB: d.pool, AMQPURLs: []string{amqpURL}, Destinations: dests,
		PollInterval: 100 * time.Millisecond, BackoffMin: 50 * time.Millisecond, BackoffMax: time.Second, Logger: d.log})
	if err != nil {
		return err
	}
	go func() { _ = r.Run(ctx) }()
	return nil
}

// downstreamResult counts what reached the downstream queue.
type downstreamResult struct {
	lost, phantom, twice int
}

// countDownstream drains the pass's downstream queue and compares it with
// the payments that committed and the tokens their attempts recorded.
func (p *passRun) countDownstream(ctx context.Context) (downstreamResult, error) {
	var res downstreamResult
	committed := map[string]bool{} // tokens of attempts that committed
	rows, err := p.pool.Query(ctx, `SELECT token FROM lab_downstream`)
	if err != nil {
		return res, err
	}
	tokens, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return res, err
	}
	for _, t := range tokens {
		committed[t] = true
	}
	conn, err := amqp.Dial(p.o.AMQPURL)
	if err != nil {
		return res, err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return res, err
	}
	seen := map[string]int{} // event -> messages
	for {
		m, ok, err := ch.Get(downstreamQueue(p.queue), true)
		if err != nil {
			return res, err
		}
		if !ok {
			break
		}
		ev, _ := m.Headers["x-lab-event"].(string)
		token, _ := m.Headers["x-lab-token"].(string)
		if ev == "" { // the relay's messages carry their event in its header, and the token in the body
			ev, _ = m.Headers["x-idem-event-id"].(string)
			token = string(m.Body)
		}
		seen[ev]++
		if !committed[token] {
			res.phantom++
		}
	}
	for _, ev := range p.stream.Events {
		switch n := seen[ev.EventID]; {
		case n == 0:
			res.lost++
		case n > 1:
			res.twice += n - 1
		}
	}
	return res, nil
}

// waitOutbox waits until the outbox approach's relays sent every row.
func (p *passRun) waitOutbox(ctx context.Context) error {
	deadline := time.Now().Add(p.o.Drain)
	for {
		var pending int
		if err := p.pool.QueryRow(ctx, `SELECT count(*) FROM idem_outbox WHERE state = 'pending'`).Scan(&pending); err != nil {
			return err
		}
		if pending == 0 || time.Now().After(deadline) {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}
