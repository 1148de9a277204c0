package chaos

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/fleet"
	"github.com/idemhq/idem/internal/horizon"
	"github.com/idemhq/idem/internal/sandbox"
)

// Fault is one injected fault as it happened.
type Fault struct {
	Kind   Kind    `json:"kind"`
	Start  float64 `json:"start"` // seconds from the start of the run
	End    float64 `json:"end"`
	Detail string  `json:"detail"`
	Err    string  `json:"error,omitempty"` // the fault could not be injected
}

// inject runs the plan: the consumer, infrastructure and API tracks each
// on their own goroutine, every fault at its planned time or, if the
// track is late, at once.
func (r *run) inject(ctx context.Context, plan []Planned) {
	var cons, infra, api []Planned
	for _, p := range plan {
		switch {
		case p.Kind.consumerFault():
			cons = append(cons, p)
		case slices.Contains(TwoHopOnly, p.Kind):
			api = append(api, p)
		default:
			infra = append(infra, p)
		}
	}
	var wg sync.WaitGroup
	for _, track := range [][]Planned{cons, infra, api} {
		wg.Go(func() {
			for _, p := range track {
				select {
				case <-ctx.Done():
					return
				case <-time.After(time.Until(r.t0.Add(p.At))):
				}
				p = r.retarget(p)
				f := Fault{Kind: p.Kind, Start: r.since()}
				detail, err := r.apply(ctx, p)
				f.End, f.Detail = r.since(), detail
				if err != nil {
					f.Err = err.Error()
					r.logf("fault %s FAILED: %v", p.Kind, err)
				} else {
					r.logf("fault %s: %s", p.Kind, detail)
				}
				r.mu.Lock()
				r.faults = append(r.faults, f)
				r.mu.Unlock()
			}
		})
	}
	wg.Wait()
}

// retarget spends a consumer fault on a crash point the run has not seen
// yet: the plan arms each step once, but an armed consumer short of CPU, or
// waiting out an outage, may not reach its step before the stream ends. A
// crash point whose step already fired, or is armed on a consumer that
// still runs, takes a missing step instead; so does a plain kill, once one
// plain kill was injected. The substitute dies on its first pass: it is
// armed late in the stream.
func (r *run) retarget(p Planned) Planned {
	if !p.Kind.consumerFault() {
		return p
	}
	seen := map[string]bool{}
	for _, fl := range []*consumers{r.fleet, r.hop} {
		if fl == nil {
			continue
		}
		for _, c := range fl.crashRecords() {
			seen[c.Step] = true
		}
		for _, s := range fl.armedSteps() {
			seen[s] = true
		}
	}
	var missing string
	for _, s := range r.steps {
		if !seen[s] {
			missing = s
			break
		}
	}
	if missing == "" {
		return p
	}
	switch p.Kind {
	case CrashPoint:
		if !seen[p.Step] {
			return p
		}
	case ConsumerKill:
		r.mu.Lock()
		killed := slices.ContainsFunc(r.faults, func(f Fault) bool { return f.Kind == ConsumerKill })
		r.mu.Unlock()
		if !killed {
			return p
		}
	}
	p.Kind, p.Step, p.After = CrashPoint, missing, 1
	return p
}

// apply injects one fault and, for a fault with a duration, ends it.
func (r *run) apply(ctx context.Context, p Planned) (string, error) {
	hold := func() {
		select {
		case <-ctx.Done():
		case <-time.After(p.For):
		}
	}
	switch p.Kind {
	case ConsumerKill:
		fl, slot := r.slot(p.Slot)
		return "SIGKILL " + fl.kill(slot), nil
	case HotRow:
		return r.holdHotRows(ctx, p.For)
	case Prune:
		return r.prune(ctx)
	case CrashPoint:
		fl, slot := r.slot(p.Slot)
		name, err := fl.arm(slot, p.Step, p.After)
		return fmt.Sprintf("%s armed to SIGKILL itself at %s (pass %d)", name, p.Step, p.After), err
	case QueueDelete:
		return r.deleteQueue(ctx, p.For)
	case HTTPFail, HTTPSlow, HTTP401:
		status := map[Kind]int{HTTPFail: http.StatusServiceUnavailable, HTTP401: http.StatusUnauthorized}[p.Kind]
		r.api.set(status, p.Kind == HTTPSlow)
		hold()
		r.api.set(0, false)
		if status != 0 {
			return fmt.Sprintf("the API answered %d for %s", status, p.For), nil
		}
		return fmt.Sprintf("the API answered after %s (past the relays' 1s timeout) for %s", r.api.slow, p.For), nil
	case RedisKill:
		node, what := r.redisTarget(ctx)
		node.Kill()
		hold()
		return fmt.Sprintf("%s killed, down for %s", what, p.For), node.Start()
	case RedisPause:
		node, what := r.redisTarget(ctx)
		err := node.Pause(ctx, p.For)
		hold()
		return fmt.Sprintf("CLIENT PAUSE %s ALL on %s", p.For, what), err
	case RedisSlow:
		node, what := r.redisTarget(ctx)
		sctx, cancel := context.WithTimeout(ctx, p.For)
		defer cancel()
		return fmt.Sprintf("DEBUG SLEEP %s in a loop for %s on %s", p.Lag, p.For, what), node.Slow(sctx, p.Lag)
	case RedisFlush:
		node, what := r.redisTarget(ctx)
		return "FLUSHALL on " + what, node.Do(ctx, "FLUSHALL")
	case RedisEvict:
		// 256 KB above what Redis holds now is room for a thousand or so
		// markers: from then on, every write evicts a random key.
		node, what := r.redisTarget(ctx)
		ectx, cancel := context.WithTimeout(ctx, p.For)
		defer cancel()
		return fmt.Sprintf("maxmemory = used + 256kb, allkeys-random, for %s on %s", p.For, what), node.Evict(ectx, 256<<10, "allkeys-random")
	case PGTerminate:
		total := 0
		for _, pool := range r.pools {
			var n int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
				WHERE application_name = $1) t`, r.appName).Scan(&n); err != nil {
				return "", err
			}
			total += n
		}
		return fmt.Sprintf("%d consumer sessions terminated on %d database(s)", total, len(r.pools)), nil
	case PGRestart:
		k := r.restarts % len(r.pgs)
		r.restarts++
		if err := r.pgs[k].Stop(); err != nil {
			return "", err
		}
		hold()
		what := "postgres"
		if len(r.pgs) > 1 {
			what = fmt.Sprintf("postgres shard %d", k)
		}
		return fmt.Sprintf("%s stopped (immediate), down for %s", what, p.For), r.pgs[k].Start()
	case PGFailover:
		return r.failover(ctx, p)
	case AMQPClose:
		// The consume connections and the relays': losing one ends a
		// consumer's session, or a relay's pass mid-confirm. A session
		// outlives the loss of its publishing connection (only dead
		// letters wait for the next), so that one is left alone. The proxy in front of the
		// broker closes both sockets: the consumer sees its connection
		// lost, the broker requeues what it had delivered on it.
		consuming := r.consuming
		// The fleet may be between connections (a broker fault just
		// before closed them all, and a loaded machine reconnects
		// slowly): wait for one, as relay-cut waits for a publish.
		n := 0
		for deadline := time.Now().Add(relayCutGrace); ctx.Err() == nil; time.Sleep(100 * time.Millisecond) {
			for _, cut := range r.cuts {
				n += cut.DropWhere(consuming)
			}
			if n > 0 || time.Now().After(deadline) {
				break
			}
		}
		if n == 0 {
			return "", fmt.Errorf("no consumer connection named %s* to close within %s", r.fleet.prefix, relayCutGrace)
		}
		return fmt.Sprintf("%d consumer and relay connections closed at the proxy", n), nil
	case PGBlackhole, PGReset, PGLatency, RedisBlackhole, RedisReset, RedisLatency, AMQPBlackhole, AMQPReset, APIBlackhole:
		return r.linkFault(ctx, p)
	case RelayCut:
		// Publishes and confirms through the proxies are the relays' and
		// the dead letters' (acks of deliveries travel the other way).
		c := sandbox.Cut{Dir: sandbox.ToServer, Method: sandbox.BasicPublish, Next: true}
		where := "at its next basic.publish"
		if r.relayCuts%2 == 1 {
			c = sandbox.Cut{Dir: sandbox.ToClient, Method: sandbox.BasicAck, Next: true}
			where = "before its next confirm"
		}
		r.relayCuts++
		fired := func() (n int) {
			for _, cut := range r.cuts {
				n += cut.Fired()
			}
			return n
		}
		before := fired()
		for _, cut := range r.cuts {
			cut.Arm(c)
		}
		// Armed for p.For, and longer if no relay publishes meanwhile: a
		// fault on the infrastructure track (Postgres restarted or
		// blackholed, the broker links blackholed) can stop every relay
		// for seconds, and the fleet takes a moment to come back.
		deadline := time.Now().Add(p.For + relayCutGrace)
		for fired() == before && time.Now().Before(deadline) && ctx.Err() == nil {
			time.Sleep(50 * time.Millisecond)
		}
		for _, cut := range r.cuts {
			cut.Disarm()
		}
		if fired() == before {
			return "", fmt.Errorf("no connection reached the cut %s within %s", where, p.For+relayCutGrace)
		}
		return fmt.Sprintf("a broker connection cut %s", where), nil
	case RabbitKill:
		node, held := r.rabbitTarget(ctx)
		if node == nil {
			return "", ctx.Err()
		}
		node.Kill()
		hold()
		what := fmt.Sprintf("%d of the fleet's consume connections", held)
		if held < 0 {
			what = "no consume connection of the fleet's seen on a node but the publisher's"
		}
		return fmt.Sprintf("rabbitmq node %s killed, holding %s, down for %s", node.Name, what, p.For), node.Start(2 * time.Minute)
	}
	return "", fmt.Errorf("unknown fault kind %q", p.Kind)
}

// relayCutGrace is how much longer than planned a relay-cut stays armed
// when no relay reaches its cut.
const relayCutGrace = 10 * time.Second

// linkFault puts p's toxic on the links of p's service, one consumer's or
// every consumer's, for p.For, then heals them.
func (r *run) linkFault(ctx context.Context, p Planned) (string, error) {
	var what string
	var pick func(*links) []*sandbox.Link
	switch p.Kind {
	case PGBlackhole, PGReset, PGLatency:
		what, pick = "postgres", func(l *links) []*sandbox.Link { return l.pg }
	case RedisBlackhole, RedisReset, RedisLatency:
		what, pick = "redis", func(l *links) []*sandbox.Link {
			if l.redis == nil {
				return nil
			}
			return []*sandbox.Link{l.redis}
		}
	case AMQPBlackhole, AMQPReset:
		what, pick = "broker", func(l *links) []*sandbox.Link { return l.amqp }
	case APIBlackhole:
		what, pick = "API", func(l *links) []*sandbox.Link {
			if l.api == nil {
				return nil
			}
			return []*sandbox.Link{l.api}
		}
	}
	slots, whose := r.linkSlots(p)
	var targets []*sandbox.Link
	for _, s := range slots {
		targets = append(targets, pick(r.links[s])...)
	}
	if len(targets) == 0 {
		return "", fmt.Errorf("no %s link to break", what)
	}
	var detail string
	var jitter time.Duration
	switch p.Kind {
	case PGBlackhole, RedisBlackhole, AMQPBlackhole, APIBlackhole:
		detail = fmt.Sprintf("%s links of %s silent (nothing forwarded, nothing closed) for %s, then closed", what, whose, p.For)
	case PGReset, RedisReset, AMQPReset:
		detail = fmt.Sprintf("%s links of %s closing each connection as data flowed, for %s", what, whose, p.For)
	case PGLatency, RedisLatency:
		jitter = (p.Lag / 3).Round(time.Millisecond)
		detail = fmt.Sprintf("%s links of %s %s (± %s) late each way for %s", what, whose, p.Lag.Round(time.Millisecond), jitter, p.For)
	}
	var err error
	for _, l := range targets {
		switch p.Kind {
		case PGBlackhole, RedisBlackhole, AMQPBlackhole, APIBlackhole:
			err = l.Blackhole()
		case PGReset, RedisReset, AMQPReset:
			err = l.Reset()
		case PGLatency, RedisLatency:
			err = l.Latency(p.Lag, jitter)
		}
		if err != nil {
			break
		}
	}
	if err == nil {
		select {
		case <-ctx.Done():
		case <-time.After(p.For):
		}
	}
	for _, l := range targets {
		err = errors.Join(err, l.Heal())
	}
	return detail, err
}

// linkSlots are the slots (indexes of r.links) a link fault hits, and who
// they are: every consumer, or the one in p.Slot (an API fault's, a
// receipts consumer: only they POST to the API).
func (r *run) linkSlots(p Planned) ([]int, string) {
	if p.All {
		all := make([]int, len(r.links))
		for i := range all {
			all[i] = i
		}
		return all, "every consumer"
	}
	if p.Kind == APIBlackhole && r.hop != nil {
		s := p.Slot % r.hop.size
		return []int{r.o.Consumers + s}, fmt.Sprintf("%s%d", r.hop.prefix, s)
	}
	fl, s := r.slot(p.Slot % len(r.links))
	if fl == r.hop {
		return []int{r.o.Consumers + s}, fmt.Sprintf("%s%d", fl.prefix, s)
	}
	return []int{s}, fmt.Sprintf("%s%d", fl.prefix, s)
}

// slot maps a planned slot to its fleet: the payments consumers first, then
// the receipts consumers of a two-hop run.
func (r *run) slot(s int) (*consumers, int) {
	if r.hop != nil && s >= r.o.Consumers {
		return r.hop, s - r.o.Consumers
	}
	return r.fleet, s % r.o.Consumers
}

// redisTarget is the Redis a fault hits: the run's redis-server, or a
// master of its cluster, the first in port order.
func (r *run) redisTarget(ctx context.Context) (*sandbox.Redis, string) {
	if r.rcluster == nil {
		return r.redis, "redis-server"
	}
	masters := r.rcluster.Masters(ctx)
	if len(masters) == 0 {
		return r.rcluster.Nodes[0], "redis node :" + fmt.Sprint(r.rcluster.Nodes[0].Port)
	}
	return masters[0], fmt.Sprintf("redis master :%d", masters[0].Port)
}

// consuming reports whether a client-provided connection name is one of
// the run's consume connections or its relays' (not a publishing
// connection, whose loss ends no session).
func (r *run) consuming(name string) bool {
	ours := strings.HasPrefix(name, r.fleet.prefix) || (r.hop != nil && strings.HasPrefix(name, r.hop.prefix))
	return ours && !strings.HasSuffix(name, broker.PublishingConnectionSuffix)
}

// rabbitTarget is the node a rabbit-kill stops, and how many of the
// fleet's consume connections it holds (-1: none was seen on a node but
// the publisher's), or nil once ctx ends while it waits: the node that
// holds the most, the first partition queue's leader on a tie, never the
// publisher's. A consumer may be restarting at that moment (the run kills
// them at every crash point), and a node whose only consumer was showed no
// reconnect: while no node holds one, it asks again, for up to
// rabbitTargetWait, before it falls back to the leader.
func (r *run) rabbitTarget(ctx context.Context) (*sandbox.RabbitNode, int) {
	leader, _ := r.rabbit.Leader(r.workQueues()[0])
	deadline := time.Now().Add(rabbitTargetWait)
	for {
		if by, err := r.rabbit.Connections(r.consuming); err == nil {
			if best := r.busiest(by, leader); best != nil {
				return best, by[best.Name]
			}
		}
		if time.Now().After(deadline) {
			break
		}
		select {
		case <-ctx.Done():
			return nil, -1
		case <-time.After(500 * time.Millisecond):
		}
	}
	if leader != nil && leader != r.pubNode {
		return leader, -1
	}
	for _, n := range r.rabbit.Nodes {
		if n != r.pubNode {
			return n, -1
		}
	}
	return r.rabbit.Nodes[0], -1
}

// busiest is the node, not the publisher's, that holds the most of the
// connections counted in by (by node name), leader on a tie; nil if none
// holds one.
func (r *run) busiest(by map[string]int, leader *sandbox.RabbitNode) *sandbox.RabbitNode {
	var best *sandbox.RabbitNode
	for _, n := range r.rabbit.Nodes {
		if n == r.pubNode || by[n.Name] == 0 {
			continue
		}
		if best == nil || by[n.Name] > by[best.Name] || (by[n.Name] == by[best.Name] && n == leader) {
			best = n
		}
	}
	return best
}

// rabbitTargetWait bounds how long a rabbit-kill waits for a node that
// holds a consume connection of the fleet's.
const rabbitTargetWait = 10 * time.Second

// Sample is the fleet's state at one moment of the run.
type Sample struct {
	T float64 `json:"t"` // seconds from the start
	// Effects is the ledger rows so far, or -1 when Postgres did not answer.
	Effects int64 `json:"effects"`
	// Deliveries is the outcomes counted by every consumer so far.
	Deliveries int64 `json:"deliveries"`
	// Duplicates caught by each tier so far.
	DupRedis    int64 `json:"dupRedis"`
	DupPostgres int64 `json:"dupPostgres"`
	// BreakerOpen is the consumers whose Redis breaker is open or half-open.
	BreakerOpen int `json:"breakerOpen"`
	// Alive is the consumer processes running.
	Alive int `json:"alive"`
}

// sample records a Sample every half second until ctx ends.
func (r *run) sample(ctx context.Context) {
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	// An exited consumer's counts are final: read them once.
	final := map[*fleet.Proc]map[string]int64{}
	for {
		s := Sample{T: r.since(), Effects: -1, Alive: r.fleet.Alive()}
		qctx, cancel := context.WithTimeout(ctx, 400*time.Millisecond)
		s.Effects = r.effects(qctx)
		cancel()
		for _, p := range r.fleet.Procs() {
			exited := false
			select {
			case <-p.Done():
				exited = true
			default:
			}
			st, ok := final[p]
			if !ok {
				var err error
				if st, err = p.Stats(); err != nil {
					continue // not written yet
				}
				if exited {
					final[p] = st
				}
			}
			s.Deliveries += deliveries(st)
			s.DupRedis += st["duplicate_redis"]
			s.DupPostgres += st["duplicate_postgres"]
			if !exited && breakerState(st) != "closed" {
				s.BreakerOpen++
			}
		}
		r.mu.Lock()
		r.timeline = append(r.timeline, s)
		r.mu.Unlock()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// holdHotRows locks the balance rows updated last on every shard, as a
// poison event that updated one of them and then hung would, and lets them
// go after d (rolled back: nothing changes).
func (r *run) holdHotRows(ctx context.Context, d time.Duration) (string, error) {
	// Early in a run, on a loaded machine, the fleet may not have applied
	// a payment yet: wait for a balance row, 15 s at most.
	for end := time.Now().Add(15 * time.Second); ; {
		var any bool
		for _, pool := range r.pools {
			var n bool
			if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM account_balances)`).Scan(&n); err == nil && n {
				any = true
			}
		}
		if any || time.Now().After(end) || ctx.Err() != nil {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	var txs []pgx.Tx
	defer func() {
		for _, tx := range txs {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	held := 0
	for _, pool := range r.pools {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return "", err
		}
		txs = append(txs, tx)
		// Its own wait for a row a consumer holds is bounded: a consumer's
		// batch can hold several.
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '3s'`); err != nil {
			return "", err
		}
		// Locked in user order, as the consumers' batches lock them:
		// in any other order, one of them and this deadlocked, and
		// Postgres ended this one (a CI run's "could not be injected").
		rows, err := tx.Query(ctx, `SELECT user_id FROM account_balances WHERE user_id IN
			(SELECT user_id FROM account_balances ORDER BY updated_at DESC LIMIT 3) ORDER BY user_id FOR UPDATE`)
		if err != nil {
			return "", err
		}
		users, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return "", err
		}
		held += len(users)
	}
	if held == 0 {
		return "", errors.New("no balance row to hold yet")
	}
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
	return fmt.Sprintf("%d balance rows updated last held for %s, then let go", held, d), nil
}

// prune runs idem prune on every shard at the retention its consumers
// recorded (so it deletes only what they no longer need, in a short run
// nothing) and reports how long each waited for the claims begun before
// its cut.
func (r *run) prune(ctx context.Context) (string, error) {
	var out []string
	for i, pool := range r.pools {
		var retention, skew time.Duration
		if err := pool.QueryRow(ctx, `SELECT retention, clock_skew FROM idem_horizon`).Scan(&retention, &skew); err != nil {
			return "", fmt.Errorf("shard %d: read the recorded retention: %w", i, err)
		}
		start := time.Now()
		n, cut, err := horizon.Prune(ctx, pool, horizon.PruneConfig{Retention: retention, ClockSkew: skew, Batch: 1000})
		if err != nil {
			return "", fmt.Errorf("shard %d: %w", i, err)
		}
		out = append(out, fmt.Sprintf("shard %d: %d rows through %s in %s", i, n, cut.UTC().Format(time.RFC3339), time.Since(start).Round(time.Millisecond)))
	}
	return "pruned " + strings.Join(out, "; "), nil
}
