package cli

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/config"
	"github.com/idemhq/idem/internal/console"
	"github.com/idemhq/idem/internal/dlq"
	"github.com/idemhq/idem/internal/heartbeat"
	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/wire"
)

func runConsole(ctx context.Context, e *Env, args []string) error {
	fs := NewFlags(e, "console", `Serves the operator's console: one web page for the fleet (each consumer and
relay as it reports itself: ready or why not, kill switch, paused
destinations, Redis breaker, events per second by outcome; the queues), the
dead letters (grouped by reason and event type; replay or purge a group or
a selection, with idem dlq's fences and refusals), the outbox (per
destination: pending, dead, paused, the oldest pending; replay dead rows)
and one event (what idem inspect shows). It reads the same settings as the
other commands (--config, IDEM_*), so point it at the service's own.

Pages are open to whoever reaches the address (127.0.0.1 by default);
actions need an identity: the token in IDEM_CONSOLE_TOKEN (given on the
sign-in page; never on the command line), or --trusted-header set by a
reverse proxy that signs operators in. Every action is a POST with a CSRF
token, and is logged with who, what and how many. --read-only refuses
every action.`)
	path := fs.String("config", "", "YAML config `file`")
	e.targetFlags(fs, true, true)
	addr := fs.String("addr", "127.0.0.1:8089", "listen on `host:port`; keep it on loopback unless a proxy guards it")
	readOnly := fs.Bool("read-only", false, "refuse every action: a page to look at only")
	trusted := fs.String("trusted-header", "", "a `header` a reverse proxy sets to the signed-in user (X-Forwarded-User); a request carrying it may act")
	proxies := fs.String("trusted-proxy", "", "the `networks` (CIDR, comma-separated) --trusted-header is believed from; empty: any address that reaches the console")
	prom := fs.String("prometheus-url", "", "link the fleet page to this Prometheus `url`")
	public := fs.String("public-host", "", "the host `names` (comma-separated) the console answers to besides loopback ones: the name a reverse proxy forwards; any other Host is refused (DNS rebinding)")
	if err := Parse(fs, args); err != nil {
		return err
	}
	var nets []*net.IPNet
	for _, c := range strings.Split(*proxies, ",") {
		if c = strings.TrimSpace(c); c == "" {
			continue
		}
		_, n, err := net.ParseCIDR(c)
		if err != nil {
			return UsageErr(e, "idem console: --trusted-proxy %q: want a CIDR such as 10.0.0.0/8 or 127.0.0.1/32", c)
		}
		nets = append(nets, n)
	}
	if len(nets) > 0 && *trusted == "" {
		return UsageErr(e, "idem console: --trusted-proxy without --trusted-header names no header to believe")
	}
	token := e.Getenv("IDEM_CONSOLE_TOKEN")
	if token != "" && len(token) < 16 {
		return UsageErr(e, "idem console: IDEM_CONSOLE_TOKEN is %d characters: give at least 16 (openssl rand -hex 16)", len(token))
	}
	e.red.Add(token)
	cfg, log, dbs, err := e.LoadDB(ctx, *path)
	if err != nil {
		return err
	}
	defer dbs.Close()
	b := &consoleBackend{e: e, cfg: cfg, dbs: dbs, walking: make(chan struct{}, 1)}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		return fmt.Errorf("console: %w", err)
	}
	var hosts []string
	for _, h := range strings.Split(*public, ",") {
		if h = strings.TrimSpace(h); h != "" {
			hosts = append(hosts, h)
		}
	}
	if host, _, _ := net.SplitHostPort(ln.Addr().String()); !net.ParseIP(host).IsUnspecified() {
		hosts = append(hosts, host) // the address it was told to listen on
	}
	srv, err := console.New(b, console.Options{Token: token, TrustedHeader: *trusted, TrustedProxies: nets, ReadOnly: *readOnly, Hosts: hosts,
		PrometheusURL: *prom, Services: fmt.Sprintf("scope %s, queue %s; outbox: every scope", cfg.Scope, cfg.Queue),
		Mask: e.red.String, Log: log})
	if err != nil {
		ln.Close()
		return err
	}
	if host, _, _ := net.SplitHostPort(ln.Addr().String()); !net.ParseIP(host).IsLoopback() && token == "" && *trusted == "" && !*readOnly {
		log.Warn("the console listens beyond loopback: anyone who reaches it reads the dead letters' bodies; put it behind a proxy that signs operators in", "addr", ln.Addr().String())
	}
	hs := &http.Server{Handler: srv, ReadHeaderTimeout: 10 * time.Second}
	log.Info("console", "url", "http://"+ln.Addr().String()+"/", "read_only", *readOnly, "token", token != "", "trusted_header", *trusted)
	done := make(chan error, 1)
	go func() { done <- hs.Serve(ln) }()
	select {
	case <-ctx.Done():
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		return hs.Shutdown(sctx)
	case err := <-done:
		return err
	}
}

// consoleBackend is the console's Backend: the CLI's own reads and actions.
type consoleBackend struct {
	e   *Env
	cfg config.Config
	dbs Shards
	// walking serialises the console's walks of the dead-letter queue
	// (each reads it whole): a slot, taken within the request's time.
	walking chan struct{}
	// shown is the last read of the dead-letter page, served again for
	// dlqFresh: a page reloaded, or by many, walks the queue once.
	mu      sync.Mutex
	shown   console.DeadLetters
	shownAt time.Time
	// queued is the last read of the queues' depths, for queuesFresh:
	// each open fleet page reloads every 5 s.
	queued   []console.Queue
	queuesAt time.Time
}

// queuesFresh is how long the queues' depths are shown again before the
// next fleet page reads them anew.
const queuesFresh = 3 * time.Second

// dlqFresh is how long a read of the dead-letter queue is shown again
// before the next page load walks it anew; an action walks it at once.
const dlqFresh = 5 * time.Second

// walk runs fn on the dead-letter queue holding the walking slot, and
// gives up when ctx ends first.
func (b *consoleBackend) walk(ctx context.Context, fn func(context.Context, *dlq.Queue) error) error {
	select {
	case b.walking <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("another read or action on the dead-letter queue is still running: %w", ctx.Err())
	}
	defer func() { <-b.walking }()
	// The walk ends with the console's bound, not with the browser: a
	// page closed mid-walk does not cut it short.
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), consoleTimeout)
	defer cancel()
	q, err := dlq.Open(wctx, b.cfg.AMQPURL, b.cfg.Topology())
	if err != nil {
		return amqpURLErr(err)
	}
	defer q.Close()
	return fn(wctx, q)
}

// consoleTimeout bounds each page's reads and each action.
const consoleTimeout = 30 * time.Second

func (b *consoleBackend) Fleet(ctx context.Context) (console.Fleet, error) {
	ctx, cancel := context.WithTimeout(ctx, consoleTimeout)
	defer cancel()
	var f console.Fleet
	var errs []error
	rs, now, err := heartbeat.Read(ctx, b.dbs[0])
	if err != nil {
		errs = append(errs, dbErr(err))
	}
	for i := range rs {
		rs[i].Why = b.e.red.String(rs[i].Why)
	}
	f.Instances, f.Now = rs, now
	if f.Now.IsZero() {
		f.Now = time.Now()
	}
	ps, err := b.pauses(ctx)
	if err != nil {
		errs = append(errs, err)
	}
	f.Paused = ps
	b.mu.Lock()
	if time.Since(b.queuesAt) >= queuesFresh {
		b.mu.Unlock()
		qs := b.queues(ctx)
		b.mu.Lock()
		b.queued, b.queuesAt = qs, time.Now()
	}
	f.Queues = b.queued
	b.mu.Unlock()
	return f, errors.Join(errs...)
}

func (b *consoleBackend) pauses(ctx context.Context) ([]console.Paused, error) {
	var out []console.Paused
	for i, pool := range b.dbs {
		ps, written, err := relay.ReadPauses(ctx, pool)
		if err != nil {
			return out, dbErr(err)
		}
		for k, p := range ps {
			out = append(out, console.Paused{Destination: shardPrefix(b.dbs, i) + p.Destination, Relay: p.Relay, Class: p.Class,
				LastError: b.e.red.String(p.LastError), Since: p.Since, NextProbe: p.NextProbe, Written: written[k], Probes: p.Probes})
		}
	}
	return out, nil
}

// queues reads each queue of the stream, and its dead-letter queue, with a
// passive declare: how many messages are ready and how many consumers.
func (b *consoleBackend) queues(ctx context.Context) []console.Queue {
	t := b.cfg.Topology()
	names := append(t.Queues(), t.DeadLetterQueue)
	var out []console.Queue
	conn, _, err := broker.DialAtStart(ctx, broker.SplitURLs(b.cfg.AMQPURL), 0, amqp.Config{Properties: amqp.Table{"connection_name": "idem-console"}})
	if err != nil {
		for _, n := range names {
			out = append(out, console.Queue{Name: n, Err: b.e.red.String(err.Error())})
		}
		return out
	}
	defer conn.Close()
	for _, n := range names {
		q := console.Queue{Name: n}
		// A passive declare of a missing queue closes its channel: one
		// channel per queue.
		ch, err := conn.Channel()
		if err == nil {
			var st amqp.Queue
			st, err = ch.QueueDeclarePassive(n, true, false, false, false, nil)
			q.Messages, q.Consumers = st.Messages, st.Consumers
			_ = ch.Close()
		}
		if err != nil {
			q.Err = b.e.red.String(err.Error())
		}
		out = append(out, q)
	}
	return out
}

// letterKey names a dead letter for a selection: a hash of what tells two
// letters apart (message ID, queue, reason, error, when it was
// dead-lettered, body). Identical letters share it, and are alike to
// replay; a producer's message ID alone, often reused, never names one.
func letterKey(m dlq.Message) string {
	h := sha256.New()
	for _, part := range []string{m.D.MessageId, m.Queue, m.Reason, m.Error, m.DeadLetteredAt.UTC().Format(time.RFC3339Nano), strconv.FormatInt(m.Replays, 10)} {
		h.Write([]byte(part))
		h.Write([]byte{0})
	}
	h.Write(m.D.Body)
	return hex.EncodeToString(h.Sum(nil)[:12])
}

// eventType is a dead letter's event type: its AMQP type, else its body's
// "type" field; "(none)" if it has neither.
func eventType(m dlq.Message) string {
	if m.D.Type != "" {
		return m.D.Type
	}
	var v struct {
		Type string `json:"type"`
	}
	if json.Unmarshal(m.D.Body, &v) == nil && v.Type != "" {
		return v.Type
	}
	return "(none)"
}

// maxBodyShown is how much of a body the page shows.
const maxBodyShown = 2048

func (b *consoleBackend) letter(ctx context.Context, m dlq.Message) console.Letter {
	d := m.D
	l := console.Letter{Key: letterKey(m), EventID: m.EventID, EventIDRead: m.EventIDRead, MessageID: d.MessageId,
		Error: b.e.red.String(m.Error), Queue: m.Queue, Attempts: m.Attempts, Replays: m.Replays, At: m.DeadLetteredAt,
		ByBroker: m.ByBroker, Cut: m.Truncated(), BodyBytes: m.BodyBytes, PayloadHash: m.PayloadHash}
	body := d.Body
	if len(body) > maxBodyShown {
		body, l.BodyShownCut = body[:maxBodyShown], true
	}
	l.Body = strings.ToValidUTF8(string(body), "\uFFFD")
	for _, k := range slices.Sorted(maps.Keys(d.Headers)) {
		if k == "x-delivery-count" || !m.ByBroker && slices.Contains(shownHeaders, k) {
			continue
		}
		v := fmt.Sprint(d.Headers[k])
		if len(v) > 256 {
			v = v[:256] + "…"
		}
		l.Headers = append(l.Headers, [2]string{k, b.e.red.String(v)})
	}
	if m.Reason == wire.ReasonPayloadConflict && m.EventID != "" {
		// Both hashes, and when the original was processed.
		switch at, hash, err := originalOf(ctx, b.cfg, b.dbs, m); {
		case errors.Is(err, pgx.ErrNoRows):
			l.Original = "no dedup row (pruned?)"
		case err != nil:
			l.Original = "unread: " + b.e.red.String(err.Error())
		default:
			l.Original = fmt.Sprintf("processed %s, payload hash %x", at.UTC().Format(time.RFC3339Nano), hash)
		}
	}
	return l
}

func (b *consoleBackend) DeadLetters(ctx context.Context) (console.DeadLetters, error) {
	b.mu.Lock()
	if time.Since(b.shownAt) < dlqFresh {
		defer b.mu.Unlock()
		return b.shown, nil
	}
	b.mu.Unlock()
	var out console.DeadLetters
	err := b.walk(ctx, func(ctx context.Context, q *dlq.Queue) error {
		out = console.DeadLetters{Queue: q.DLQ}
		groups := map[[2]string]*console.Group{}
		var order [][2]string
		n, err := q.Walk(ctx, func(m dlq.Message) (dlq.Verdict, error) {
			k := [2]string{m.Reason, eventType(m)}
			g := groups[k]
			if g == nil {
				if len(groups) >= console.MaxGroups {
					out.Ungrouped++
					return dlq.Keep, nil
				}
				g = &console.Group{Reason: k[0], Type: k[1]}
				groups[k] = g
				order = append(order, k)
			}
			g.Count++
			widen(&g.Oldest, &g.Newest, m.DeadLetteredAt)
			if len(g.Letters) < console.MaxShown {
				g.Letters = append(g.Letters, b.letter(ctx, m))
			}
			return dlq.Keep, nil
		})
		out.Total = n
		for _, k := range order {
			out.Groups = append(out.Groups, *groups[k])
		}
		sort.SliceStable(out.Groups, func(i, j int) bool { return out.Groups[i].Count > out.Groups[j].Count })
		return err
	})
	if err != nil {
		return out, err
	}
	b.mu.Lock()
	b.shown, b.shownAt = out, time.Now()
	b.mu.Unlock()
	return out, nil
}

// forget drops the read the page shows again: an action changed the queue.
func (b *consoleBackend) forget() {
	b.mu.Lock()
	b.shownAt = time.Time{}
	b.mu.Unlock()
}

// picks returns whether a dead letter is one sel picks: at most sel.Max
// of them (the letters the page showed), and for a group none
// dead-lettered after sel.Before. It counts: use it for one walk.
func picks(sel console.Selection) func(dlq.Message) bool {
	taken := 0
	match := func(m dlq.Message) bool {
		return m.Reason == sel.Reason && eventType(m) == sel.Type &&
			(sel.Before.IsZero() || !m.DeadLetteredAt.After(sel.Before))
	}
	if len(sel.Keys) > 0 {
		keys := map[string]bool{}
		for _, k := range sel.Keys {
			keys[k] = true
		}
		match = func(m dlq.Message) bool { return keys[letterKey(m)] }
	}
	return func(m dlq.Message) bool {
		if taken >= sel.Max || !match(m) {
			return false
		}
		taken++
		return true
	}
}

func (b *consoleBackend) ReplayLetters(ctx context.Context, sel console.Selection) (console.Result, error) {
	defer b.forget()
	var res console.Result
	err := b.walk(ctx, func(ctx context.Context, q *dlq.Queue) error {
		c, err := q.ReplayWhere(ctx, picks(sel), false, nil)
		res = console.Result{Done: c.Replayed, Refused: c.Cut}
		if c.Cut > 0 {
			res.Note = fmt.Sprintf("%d letter(s) of reason %s carry only the first bytes of their body and stay: have their producer send them again within consumer.max_body_bytes, then purge these",
				c.Cut, wire.ReasonBodyTooLarge)
		}
		return err
	})
	return res, err
}

func (b *consoleBackend) PurgeLetters(ctx context.Context, sel console.Selection) (console.Result, error) {
	defer b.forget()
	var res console.Result
	err := b.walk(ctx, func(ctx context.Context, q *dlq.Queue) error {
		match := picks(sel)
		_, err := q.Walk(ctx, func(m dlq.Message) (dlq.Verdict, error) {
			if !match(m) {
				return dlq.Keep, nil
			}
			res.Done++
			return dlq.Remove, nil
		})
		return err
	})
	return res, err
}

func (b *consoleBackend) Outbox(ctx context.Context) (console.Outbox, error) {
	ctx, cancel := context.WithTimeout(ctx, consoleTimeout)
	defer cancel()
	var out console.Outbox
	ps, err := b.pauses(ctx)
	if err != nil {
		return out, err
	}
	out.Paused = ps
	paused := map[string]bool{}
	for _, p := range ps {
		paused[p.Destination] = true
	}
	for i, pool := range b.dbs {
		// Pending and dead rows only, through their partial indexes: the
		// sent rows of a day may be millions.
		rows, err := pool.Query(ctx, `SELECT destination, count(*) FILTER (WHERE state = 'pending'), count(*) FILTER (WHERE state = 'dead'),
			coalesce((extract(epoch FROM max(clock_timestamp() - created_at) FILTER (WHERE state = 'pending')) * 1000)::bigint, 0)
		FROM (SELECT destination, state, created_at FROM idem_outbox WHERE state = 'pending' UNION ALL
		      SELECT destination, state, created_at FROM idem_outbox WHERE state = 'dead') r
		GROUP BY destination ORDER BY destination`)
		if err != nil {
			return out, dbErr(err)
		}
		for rows.Next() {
			var d console.Destination
			var oldestMS int64
			if err := rows.Scan(&d.Name, &d.Pending, &d.Dead, &oldestMS); err != nil {
				rows.Close()
				return out, dbErr(err)
			}
			d.Name, d.OldestPending = shardPrefix(b.dbs, i)+d.Name, time.Duration(oldestMS)*time.Millisecond
			d.Paused = paused[d.Name]
			out.Destinations = append(out.Destinations, d)
		}
		if err := rows.Err(); err != nil {
			return out, dbErr(err)
		}
		dead, err := relay.List(ctx, pool, relay.Filter{State: "dead", Limit: 200})
		if err != nil {
			return out, dbErr(err)
		}
		for _, m := range dead {
			id := strconv.FormatInt(m.ID, 10)
			if len(b.dbs) > 1 {
				id = strconv.Itoa(i) + ":" + id
			}
			out.Dead = append(out.Dead, console.Row{ID: id, MessageID: m.MessageID, Scope: m.Scope, EventID: m.EventID,
				Destination: m.Destination, State: m.State, LastError: b.e.red.String(m.LastError), Attempts: m.Attempts, Created: m.CreatedAt})
		}
	}
	return out, nil
}

func (b *consoleBackend) ReplayOutbox(ctx context.Context, dest string, ids []string) (console.Result, error) {
	ctx, cancel := context.WithTimeout(ctx, consoleTimeout)
	defer cancel()
	perShard := make([][]int64, len(b.dbs))
	for _, s := range ids {
		shard, id := 0, s
		if len(b.dbs) > 1 {
			sh, rest, ok := strings.Cut(s, ":")
			n, err := strconv.Atoi(sh)
			if !ok || err != nil || n < 0 || n >= len(b.dbs) {
				return console.Result{}, fmt.Errorf("row %q: want shard:id", s)
			}
			shard, id = n, rest
		}
		n, err := strconv.ParseInt(id, 10, 64)
		if err != nil || n < 1 {
			return console.Result{}, fmt.Errorf("row %q: not a row id", s)
		}
		perShard[shard] = append(perShard[shard], n)
	}
	var res console.Result
	for i, pool := range b.dbs {
		f := relay.Filter{}
		switch {
		case len(ids) > 0 && len(perShard[i]) == 0:
			continue // no row of this shard picked: never every row
		case len(ids) > 0:
			f.IDs = perShard[i]
		default:
			name, ok := strings.CutPrefix(dest, shardPrefix(b.dbs, i))
			if !ok || name == "" {
				continue // never every row
			}
			f.Destination = name
		}
		n, err := relay.ReplayWhere(ctx, pool, f)
		res.Done += int(n)
		if err != nil {
			return res, dbErr(err)
		}
	}
	return res, nil
}

func (b *consoleBackend) Inspect(ctx context.Context, id string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, consoleTimeout)
	defer cancel()
	var out bytes.Buffer
	sub := *b.e
	sub.Stdout, sub.Stderr = &out, &out
	if err := inspectEvent(ctx, &sub, &out, b.cfg, b.dbs, id); err != nil {
		if errors.Is(err, ErrUsage) {
			return "", errors.New(b.e.red.String(strings.TrimSpace(out.String())))
		}
		return b.e.red.String(out.String()), err
	}
	return b.e.red.String(out.String()), nil
}
