package consumer

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/guard"
)

// Consumer runs a Handler behind a Guard on one queue. Start any number of
// them, in any number of processes, on the same queue.
type Consumer[T any] struct {
	shared[T]
	urls     []string    // the broker nodes, tried in turn
	node     int         // the index in urls the next session tries first
	queues   []string    // the queues this consumer takes
	consumed atomic.Bool // a session reached Consume: start-up is over
	// refused explains the refusal that ended the last session (see
	// broker.IsRefused); nil once a session consumes, or ends otherwise.
	refused atomic.Pointer[string]
	// live is the acker of the session consuming now; nil between sessions.
	live atomic.Pointer[acker]
	// pubs is the publishing side of the session now; nil between sessions.
	pubs atomic.Pointer[publishing]
	// strays are the stream's queues outside its layout; stranded what
	// the last check found in them.
	strays   []string
	stranded atomic.Pointer[map[string]int]
}

// New returns a Consumer, or an error naming the bad Config field.
func New[T any](cfg Config, g *guard.Guard, h Handler[T]) (*Consumer[T], error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if g == nil || h == nil {
		return nil, errors.New("consumer: guard and handler are required")
	}
	cfg.Logger = cfg.Logger.With("scope", g.Scope())
	t := broker.TopologyFor(cfg.Queue, cfg.BrokerDeliveryLimit)
	t.Partitions = cfg.Partitions
	c := &Consumer[T]{shared: shared[T]{cfg: cfg, guard: g, handler: h, topology: t, kill: newKillSwitch(cfg.KillSwitch, cfg.Logger, cfg.Observer)},
		urls: broker.SplitURLs(cfg.URL)}
	c.queues = t.Queues()
	c.strays = t.Strays(cfg.FormerPartitions)
	if len(cfg.Only) > 0 {
		c.queues = nil
		for _, p := range slices.Compact(slices.Sorted(slices.Values(cfg.Only))) {
			c.queues = append(c.queues, t.PartitionQueue(p))
		}
	}
	return c, nil
}

// Stats reports the consumer's state now. It is safe to call at any time,
// from any goroutine.
func (c *Consumer[T]) Stats() Stats {
	s := Stats{Prefetch: c.cfg.Prefetch}
	if a := c.live.Load(); a != nil {
		unsettled, held := a.counts()
		s.Consuming, s.InFlight, s.Unacked = true, unsettled, unsettled+held
	}
	s.Blocked, _ = c.blocked.state()
	if p := c.pubs.Load(); p != nil {
		if err := p.down(); err != nil {
			s.Publishing = err.Error()
		}
	}
	if why := c.refused.Load(); why != nil {
		s.Refused = *why
	}
	s.Tripped, s.TrippedOn = c.kill.state()
	if n := c.progress.Load(); n != 0 {
		s.LastSettled = time.Unix(0, n)
	}
	if m := c.stranded.Load(); m != nil {
		for _, q := range slices.Sorted(maps.Keys(*m)) {
			s.Stranded += (*m)[q]
			s.StrandedIn = append(s.StrandedIn, q)
		}
	}
	return s
}

// Run consumes until ctx ends, reconnecting with backoff whenever the
// connection or a channel is lost. It returns an error at once if the queue
// exists with arguments other than the Config asks for. Before a session
// has consumed, it returns ErrBrokerRefused once RabbitMQ has refused the
// connection (credentials, vhost) a few times in a row over a few seconds
// (broker.RefusedTries, broker.RefusedFor), and ErrBrokerUnreachable after
// StartupTimeout. Once one has, a refusal is retried like any failure, for
// as long as it lasts: amqp091 reports a connection dropped during the
// handshake (a broker restarting, a network fault) as bad credentials, and
// a fleet must not exit on it. Each refusal is counted ("broker_refusals")
// and Stats.Refused says why the consumer is not consuming. When ctx ends
// it stops taking deliveries, lets in-flight work finish (up to
// DrainTimeout), acks what committed and closes. It returns nil after a
// clean drain. While the kill switch is open (see KillSwitch) it takes no
// delivery until the next probe.
func (c *Consumer[T]) Run(ctx context.Context) error {
	log := c.cfg.Logger
	began := time.Now()
	var refusals broker.Refusals
	for attempt := 1; ; attempt++ {
		if !c.kill.awaitProbe(ctx.Done()) {
			return nil
		}
		started := time.Now()
		err := c.session(ctx)
		if ctx.Err() != nil {
			return nil
		}
		refused := broker.IsRefused(err)
		lasting := refusals.Add(err, time.Now())
		starting := !c.consumed.Load()
		switch {
		case isBadTopology(err):
			// The queue exists with other arguments: retrying cannot help,
			// and a fleet member spinning on it would hide the mistake.
			return err
		case starting && refused && (lasting || time.Since(began) >= c.cfg.StartupTimeout):
			return broker.Lasting(err)
		case starting && time.Since(began) >= c.cfg.StartupTimeout:
			return fmt.Errorf("%w within StartupTimeout (%s): %w", ErrBrokerUnreachable, c.cfg.StartupTimeout, err)
		}
		if errors.Is(err, errTripped) || errors.Is(err, errResumed) {
			// The kill switch ended the session after a clean drain: the
			// next one waits for the probe, or takes the full prefetch.
			attempt = 0
			continue
		}
		if errors.Is(err, errStoreAway) {
			// Take no delivery while the store is away: wait for it, then
			// consume again at once.
			if !c.awaitStore(ctx) {
				return nil
			}
			attempt = 0
			continue
		}
		c.cfg.Observer.Count(wire.CounterReconnect, 1)
		if time.Since(started) > c.cfg.ReconnectBackoff.Max {
			attempt = 1 // the session was healthy for a while: start over
		}
		delay := c.cfg.ReconnectBackoff.Delay(attempt)
		if refused {
			why := broker.Explain(err).Error()
			c.refused.Store(&why)
			c.cfg.Observer.Count(wire.CounterBrokerRefused, 1)
			log.Warn("amqp session refused, reconnecting", "err", why, "attempt", attempt, "delay", delay)
		} else {
			c.refused.Store(nil)
			log.Warn("amqp session ended, reconnecting", "err", err, "attempt", attempt, "delay", delay)
		}
		if !sleep(ctx, delay) {
			return nil
		}
	}
}

// awaitStore pings the guard's stores with backoff until they all answer;
// it reports false if ctx ended first.
func (c *Consumer[T]) awaitStore(ctx context.Context) bool {
	for wait := 1; ; wait++ {
		pctx, cancel := context.WithTimeout(ctx, c.cfg.HandlerTimeout)
		err := c.guard.Ping(pctx)
		cancel()
		if err == nil {
			c.cfg.Logger.Info("the store answers again: consuming")
			return true
		}
		delay := c.cfg.RetryBackoff.Delay(wait)
		if wait == 1 {
			c.cfg.Logger.Warn("the store stayed unreachable for store_hold: every delivery handed back, consuming nothing until it answers",
				"err", err, "store_hold", c.cfg.StoreHold)
		}
		if !sleep(ctx, delay) {
			return false
		}
	}
}

// session is one connection's life: declare, consume, work, drain.
func (c *Consumer[T]) session(ctx context.Context) error {
	conn, node, err := broker.DialContext(ctx, c.urls, c.node, amqp.Config{
		Properties: amqp.Table{"connection_name": c.cfg.ConnectionName},
		Heartbeat:  10 * time.Second,
		// The broker sends header frames above its own frame_max (a quorum
		// queue's x-delivery-count on a producer's near-limit headers): the
		// consuming connection reads them rather than being closed by them.
		FrameSize: broker.ReadFrameMax,
	})
	if err != nil {
		return fmt.Errorf("dial: %w", err)
	}
	defer conn.Close()
	// The next session starts at the next node: if this one's node is
	// lost, the reconnect goes elsewhere first.
	c.node = node + 1
	connClosed := conn.NotifyClose(make(chan *amqp.Error, 1))

	c.blocked.set(amqp.Blocking{}) // a new connection starts unblocked
	defer c.blocked.set(amqp.Blocking{})
	if err := declare(conn, c.topology.Declare); err != nil {
		return &declareError{err}
	}
	// The publishing connection is opened beside the session, not before
	// it: consuming never waits for it, and only dead letters wait while
	// it is away (sendLetter).
	pubs := startPublishing(ctx, func(ctx context.Context) (*broker.Publisher, error) { return c.openPublisher(ctx, node) },
		c.cfg.ReconnectBackoff, c.cfg.Logger, func() { c.blocked.set(amqp.Blocking{}) },
		func() { c.cfg.Observer.Count(wire.CounterReconnect, 1) })
	defer pubs.close()
	c.pubs.Store(pubs)
	defer c.pubs.Store(nil)
	// A probe takes one delivery per queue: one event decides whether the
	// deploy works again, and a failure hands back that one alone.
	probe := c.kill.probing()
	prefetch := max(1, c.cfg.Prefetch/len(c.queues))
	if probe {
		prefetch = 1
	}
	sub, err := c.subscribe(conn, prefetch)
	if err != nil {
		return err
	}
	watchCtx, stopWatching := context.WithCancel(ctx)
	watched := make(chan struct{})
	go func() { defer close(watched); c.watchStrays(watchCtx, conn) }()
	defer func() { stopWatching(); <-watched }()
	c.consumed.Store(true)
	c.refused.Store(nil)
	if probe {
		c.cfg.Logger.Info("consuming a probe", "queues", c.queues, "node", node+1, "prefetch", 1)
	} else {
		c.cfg.Logger.Info("consuming", "queues", c.queues, "node", node+1, "prefetch", c.cfg.Prefetch, "workers", c.cfg.Workers,
			"batch_size", c.cfg.BatchSize, "batch_linger", c.cfg.BatchLinger)
	}

	// In-flight work outlives ctx by up to DrainTimeout, so that SIGTERM
	// finishes and acks what it can instead of abandoning it.
	workCtx, cancelWork := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelWork()
	// stop ends backoff waits as soon as shutdown begins or the session fails.
	stop, stopWaits := context.WithCancel(ctx)
	defer stopWaits()
	ends := sessionEnds{away: make(chan struct{}), tripped: make(chan struct{}), resumed: make(chan struct{})}
	w := &worker[T]{c: &c.shared, storeAway: onceCloser(ends.away), trip: onceCloser(ends.tripped), resume: onceCloser(ends.resumed),
		tripped: ends.tripped, pubs: pubs, acker: newAcker(sub.ch, prefetch/2), stop: stop, queueOf: sub.queueOf,
		letters: make(chan letter[T], c.cfg.Prefetch)}
	c.live.Store(w.acker)
	defer c.live.Store(nil)
	if probe {
		// A probe that meets no delivery finds the queue empty: resume
		// (the switch stays armed) rather than stay unready for nothing.
		idle := time.AfterFunc(c.cfg.KillSwitch.Probe.Min+c.cfg.HandlerTimeout, func() {
			if c.kill.probeIdle() {
				w.resume()
			}
		})
		defer idle.Stop()
	}
	workersDone := w.start(workCtx, sub.deliveries)

	cause := c.awaitEnd(ctx, connClosed, sub, workersDone, ends)
	// The kill switch ends a session as shutdown does: the consumers are
	// cancelled, and what the workers hold drains (after a trip, each
	// delivery goes back to the queue untried, and with KeyOrder its key
	// held), so that nothing the session settled is redelivered.
	graceful := cause == nil || errors.Is(cause, errTripped) || errors.Is(cause, errResumed)
	if cause != nil {
		stopWaits()
	}
	if !graceful {
		// Close the consume channel so deliveries closes and the workers
		// return; their unacked deliveries go back to the queue. The acks
		// held for a multiple-ack go first, where the channel still takes
		// them: their outcomes are durable, and would come back as
		// duplicates.
		if !sub.ch.IsClosed() {
			w.acker.flush()
		}
		_ = sub.ch.Close()
	}
	if errors.Is(cause, errStoreAway) {
		// The store is away and the broker has every delivery back: roll
		// back what is in flight now rather than try it again, and say at
		// once that this consumer consumes nothing.
		c.live.Store(nil)
		cancelWork()
	}
	drain := time.NewTimer(c.cfg.DrainTimeout)
	defer drain.Stop()
	select {
	case <-workersDone:
	case <-drain.C:
		c.cfg.Logger.Warn("drain timeout: rolling back in-flight work", "drain_timeout", c.cfg.DrainTimeout)
		cancelWork()
		<-workersDone
	}
	if !graceful {
		return cause
	}
	w.acker.flush()
	_ = sub.ch.Close()
	pubs.close()
	if err := conn.Close(); err != nil && !errors.Is(err, amqp.ErrClosed) {
		return fmt.Errorf("close: %w", err)
	}
	if cause != nil {
		return cause
	}
	c.cfg.Logger.Info("drained and closed", "queues", c.queues)
	return nil
}

// sessionEnds are what a session's workers close to end it: the store stayed
// away, the kill switch tripped, or a probe closed it.
type sessionEnds struct {
	away, tripped, resumed chan struct{}
}

// onceCloser returns a func that closes ch, safe to call more than once.
func onceCloser(ch chan struct{}) func() {
	var once sync.Once
	return func() { once.Do(func() { close(ch) }) }
}

// declare runs the topology's declarations on a channel of conn of their
// own.
func declare(conn *amqp.Connection, declare func(*amqp.Channel) error) error {
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open a channel to declare: %w", err)
	}
	defer ch.Close()
	return declare(ch)
}

// openPublisher opens a session's publishing side: a connection of its own,
// to the node of the consuming connection, with a confirming publisher,
// and declares the dead-letter exchange and queue on it (one deleted since
// is back before a letter needs it). Not the work queues: the consuming
// connection declared them, and one deleted since the session began must
// end it (the broker cancels its consumer), not come back under it. During
// a memory or disk alarm the broker stops reading a connection that
// publishes, and acks sent on it would stop with the publish.
func (c *Consumer[T]) openPublisher(ctx context.Context, node int) (*broker.Publisher, error) {
	conn, _, err := broker.DialContext(ctx, c.urls[node:node+1], 0, amqp.Config{
		Properties: amqp.Table{"connection_name": c.cfg.ConnectionName + broker.PublishingConnectionSuffix},
		Heartbeat:  10 * time.Second,
	})
	if err != nil {
		return nil, fmt.Errorf("dial publishing connection: %w", err)
	}
	pub, err := broker.NewPublisher(conn, broker.PublisherOptions{OnBlocked: c.onBlocked})
	if err != nil {
		return nil, fmt.Errorf("publishing connection: %w", err)
	}
	if err := pub.Declare(c.topology.DeclareDeadLetter); err != nil {
		_ = pub.Close()
		return nil, fmt.Errorf("declare on the publishing connection: %w", err)
	}
	return pub, nil
}

// subscription is a session's consume channel, with one consumer per queue
// on it: delivery tags are the channel's, so one acker covers them all.
type subscription struct {
	ch         *amqp.Channel
	closed     chan *amqp.Error
	queueOf    map[string]string // consumer tag → queue
	deliveries <-chan amqp.Delivery
	// cancelled names a consumer the broker cancelled (its queue deleted,
	// a leader moving away): it would leave its queue unconsumed while the
	// session goes on with the others, so the session ends instead, and
	// the next one consumes every queue again.
	cancelled chan string
}

// subscribe consumes every queue on one channel, prefetch deliveries per
// queue.
func (c *Consumer[T]) subscribe(conn *amqp.Connection, prefetch int) (*subscription, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open consume channel: %w", err)
	}
	s := &subscription{ch: ch, closed: ch.NotifyClose(make(chan *amqp.Error, 1)), queueOf: map[string]string{}}
	// Quorum queues take no channel-wide (global) prefetch: each queue's
	// consumer gets its share, so the channel holds at most Prefetch.
	if err := ch.Qos(prefetch, 0, false); err != nil {
		return nil, fmt.Errorf("set prefetch: %w", err)
	}
	var sources []<-chan amqp.Delivery
	for _, q := range c.queues {
		tag := fmt.Sprintf("%s-%d-%s", c.cfg.ConnectionName, time.Now().UnixNano(), q)
		ds, err := ch.Consume(q, tag, false, false, false, false, nil)
		if err != nil {
			return nil, fmt.Errorf("consume %q: %w", q, err)
		}
		s.queueOf[tag] = q
		sources = append(sources, ds)
	}
	s.deliveries = merge(sources)
	s.cancelled = ch.NotifyCancel(make(chan string, len(c.queues)))
	return s, nil
}

// start runs the pipeline on deliveries: gather → screen (one goroutine:
// decode, Redis) → decide (Workers goroutines: the Postgres transactions),
// the confirm stage (a goroutine a shard: settles the duplicates Redis knows
// once the store confirmed their markers' history, and another acks them),
// and the dead-letter sender. The returned channel closes once every stage
// has returned and every letter was sent or handed back.
func (w *worker[T]) start(ctx context.Context, deliveries <-chan amqp.Delivery) <-chan struct{} {
	// Dead letters are published by a goroutine of their own, so that one
	// waiting for its confirm (or for a blocked connection to clear) never
	// holds up the pipeline. It ends after the workers, once it has sent
	// or handed back every letter they gave it.
	lettersSent := make(chan struct{})
	go func() { defer close(lettersSent); w.sendLetters(ctx) }()
	batches := make(chan []amqp.Delivery)
	toDecide := make(chan screened[T])
	// Buffered for every batch that can be in flight, so that no stage
	// blocks telling the gatherer a batch finished, even after it returned.
	finished := make(chan struct{}, w.c.cfg.Workers+3)
	// The confirm stage ends after the stages that feed it, once it has
	// settled every batch they gave it.
	var confirmers sync.WaitGroup
	w.confirms = make([]*confirmShard[T], w.c.guard.Shards())
	for i := range w.confirms {
		c := newConfirmShard[T]()
		w.confirms[i] = c
		confirmers.Go(func() {
			defer c.acks.close()
			w.confirmStage(c)
		})
		confirmers.Go(func() { w.ackStage(ctx, c) })
	}
	var wg sync.WaitGroup
	wg.Go(func() { w.gather(w.intake(deliveries), batches, finished) })
	wg.Go(func() { w.screenStage(ctx, batches, toDecide, finished) })
	for range w.c.cfg.Workers {
		wg.Go(func() {
			for s := range toDecide {
				w.decide(ctx, s)
				w.deciding.Add(-1)
				if s.gathered {
					finished <- struct{}{}
				}
			}
		})
	}
	done := make(chan struct{})
	go func() {
		wg.Wait()
		for _, c := range w.confirms {
			c.queue.close()
		}
		confirmers.Wait()
		w.leftovers.Wait()
		close(w.letters)
		<-lettersSent
		close(done)
	}()
	return done
}

// awaitEnd waits for shutdown (nil: it cancels the consumers, and the
// library then closes the deliveries) or for what ends the session (its
// cause).
func (c *Consumer[T]) awaitEnd(ctx context.Context, connClosed chan *amqp.Error, sub *subscription, workersDone <-chan struct{}, ends sessionEnds) error {
	cancel := func() {
		for tag := range sub.queueOf {
			if err := sub.ch.Cancel(tag, false); err != nil {
				c.cfg.Logger.Warn("cancel consumer", "err", err)
			}
		}
	}
	select {
	case <-ctx.Done():
		cancel()
		return nil
	case <-ends.tripped:
		cancel()
		return errTripped
	case <-ends.resumed:
		cancel()
		return errResumed
	case e := <-connClosed:
		return fmt.Errorf("connection closed: %w", amqpErr(e))
	case e := <-sub.closed:
		return fmt.Errorf("consume channel closed: %w", amqpErr(e))
	case tag, ok := <-sub.cancelled:
		if !ok {
			return errors.New("consume channel closed")
		}
		return fmt.Errorf("%w: queue %q", ErrConsumerCancelled, sub.queueOf[tag])
	case <-workersDone:
		return errors.New("delivery channel closed")
	case <-ends.away:
		return errStoreAway
	}
}

// strayCheckEvery is how often a session looks for messages stranded in
// the stream's queues outside its layout. A queue found missing is looked
// for again only every strayMissingEvery checks (a minute): each look at a
// missing queue closes a channel and costs a line in the broker's log, and
// most strays (the partitions beyond the count) never exist.
const (
	strayCheckEvery   = 10 * time.Second
	strayMissingEvery = 6
)

// watchStrays checks the stream's stray queues (broker.Topology.Strays) at once and
// then every strayCheckEvery until ctx ends, records what it finds for
// Stats, and logs an error whenever the count of stranded messages changes.
func (c *Consumer[T]) watchStrays(ctx context.Context, conn *amqp.Connection) {
	if len(c.strays) == 0 {
		return
	}
	var ch *amqp.Channel
	defer func() {
		if ch != nil {
			ch.Close()
		}
	}()
	t := time.NewTicker(strayCheckEvery)
	defer t.Stop()
	last := -1
	skip := map[string]int{} // checks a missing queue sits out
	for {
		found := map[string]int{}
		for _, q := range c.strays {
			if skip[q] > 0 {
				skip[q]--
				continue
			}
			if ch == nil || ch.IsClosed() {
				var err error
				if ch, err = conn.Channel(); err != nil {
					return // the session is ending
				}
			}
			// A passive declare of a queue that does not exist closes the
			// channel: the queue is simply not there.
			info, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
			var notFound *amqp.Error
			switch {
			case err == nil && info.Messages > 0:
				found[q] = info.Messages
			case errors.As(err, &notFound) && notFound.Code == amqp.NotFound:
				skip[q] = strayMissingEvery - 1
			}
		}
		c.stranded.Store(&found)
		total := 0
		for _, n := range found {
			total += n
		}
		if total != last && (total > 0 || last > 0) {
			if total > 0 {
				c.cfg.Logger.Error("messages stranded in queues of the stream that nobody consumes: a publisher uses another partition count; move them with a shovel or publish them again, then fix the publisher",
					"stranded", found, "partitions", max(c.cfg.Partitions, 1))
			} else {
				c.cfg.Logger.Info("no messages stranded any more")
			}
		}
		last = total
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// onBlocked records the broker's connection.blocked and
// connection.unblocked notifications for the publishing connection.
func (c *Consumer[T]) onBlocked(n amqp.Blocking) {
	c.blocked.set(n)
	if n.Active {
		c.cfg.Observer.Count(wire.CounterPublishBlocked, 1)
		c.cfg.Logger.Warn("the broker blocks publishing (a resource alarm): dead letters wait, acks go on", "reason", n.Reason)
	} else {
		c.cfg.Logger.Info("the broker unblocked publishing")
	}
}

// merge forwards every source's deliveries to one channel, closed once
// every source is.
func merge(sources []<-chan amqp.Delivery) <-chan amqp.Delivery {
	if len(sources) == 1 {
		return sources[0]
	}
	out := make(chan amqp.Delivery)
	var wg sync.WaitGroup
	for _, src := range sources {
		wg.Go(func() {
			for d := range src {
				out <- d
			}
		})
	}
	go func() { wg.Wait(); close(out) }()
	return out
}

func amqpErr(e *amqp.Error) error {
	if e == nil {
		return amqp.ErrClosed
	}
	return e
}

// declareError marks a failure to declare the topology.
type declareError struct{ err error }

func (e *declareError) Error() string { return e.err.Error() }
func (e *declareError) Unwrap() error { return e.err }

// errStoreAway ends a session whose store stayed unreachable for a
// delivery's StoreHold: the next session waits for the store first.
var errStoreAway = errors.New("the store stayed unreachable for store_hold: every delivery handed back")

// Errors Run returns at start.
var (
	// ErrBrokerRefused: RabbitMQ kept refusing the connection, or dropping
	// it during the handshake, before any session consumed (see Run): the
	// credentials, the vhost, a permission or a connection limit.
	ErrBrokerRefused = broker.ErrRefused
	// ErrBrokerUnreachable: no session reached Consume within StartupTimeout.
	ErrBrokerUnreachable = errors.New("RabbitMQ was not reachable")
	// ErrConsumerCancelled ends a session: the broker cancelled the
	// consumer of one of its queues (deleted, or its leader moved), and
	// the session reconnects to consume them all again.
	ErrConsumerCancelled = errors.New("the broker cancelled a consumer")
)

// isBadTopology reports a declaration the broker refused with 406 because it
// contradicts what exists. Other 406s (an ack timeout on a delivery held
// while Postgres was down, say) end only the session.
func isBadTopology(err error) bool {
	var de *declareError
	var ae *amqp.Error
	return errors.As(err, &de) && errors.As(err, &ae) && ae.Code == amqp.PreconditionFailed
}
