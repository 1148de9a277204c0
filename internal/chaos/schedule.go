package chaos

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	"github.com/idemhq/idem/internal/step"
)

// Kind names a fault.
type Kind string

// The fault kinds. Consumer faults hit the fleet's processes; the others hit
// the run's own Redis and Postgres, the consumers' broker connections, or
// the links every consumer reaches its services through (the link kinds:
// one consumer's link or every consumer's).
const (
	ConsumerKill   Kind = "consumer-kill"   // SIGKILL a random consumer; it is restarted
	CrashPoint     Kind = "crash-point"     // restart a consumer armed to SIGKILL itself at a named step
	RedisKill      Kind = "redis-kill"      // SIGKILL redis-server (every key lost), restart it later
	RedisPause     Kind = "redis-pause"     // CLIENT PAUSE ALL: Redis stops answering for a while
	RedisSlow      Kind = "redis-slow"      // DEBUG SLEEP in a loop: Redis answers late
	RedisFlush     Kind = "redis-flush"     // FLUSHALL: every lease and done marker lost
	RedisEvict     Kind = "redis-evict"     // tight maxmemory, allkeys-random: Redis evicts as it is written to
	PGTerminate    Kind = "pg-terminate"    // pg_terminate_backend on every consumer session
	PGRestart      Kind = "pg-restart"      // stop the run's Postgres in immediate mode, start it later
	PGFailover     Kind = "pg-failover"     // kill the run's primary mid-stream, promote its standby, re-point the links, add a standby
	AMQPClose      Kind = "amqp-close"      // close the consumers' consume and relay connections at the proxy
	PGBlackhole    Kind = "pg-blackhole"    // Postgres links forward nothing, close nothing, for a while
	PGReset        Kind = "pg-reset"        // Postgres links close every connection as data flows, briefly
	PGLatency      Kind = "pg-latency"      // Postgres links delay every chunk, for a while
	RedisBlackhole Kind = "redis-blackhole" // pg-blackhole on the Redis links (not with --cluster)
	RedisReset     Kind = "redis-reset"     // pg-reset on the Redis links (not with --cluster)
	RedisLatency   Kind = "redis-latency"   // pg-latency on the Redis links (not with --cluster)
	AMQPBlackhole  Kind = "amqp-blackhole"  // broker links forward nothing, close nothing, for a while
	AMQPReset      Kind = "amqp-reset"      // broker links close every connection as data flows, briefly
	RabbitKill     Kind = "rabbit-kill"     // --cluster: SIGKILL the RabbitMQ node most consumers are on, restart it later
	HTTPFail       Kind = "http-fail"       // two hops: the API answers 503 for a while
	HTTPSlow       Kind = "http-slow"       // two hops: the API answers after the relays gave up on it, for a while
	HTTP401        Kind = "http-401"        // two hops: the API answers 401 (a rotated credential), for a while: the relays pause it
	QueueDelete    Kind = "queue-delete"    // two hops: delete a receipts partition queue with its messages; the relays resend what it held
	RelayCut       Kind = "relay-cut"       // two hops: cut a relay's broker connection mid-pass, at a publish or before a confirm
	APIBlackhole   Kind = "api-blackhole"   // two hops: the relays' links to the API forward nothing, for a while
	HotRow         Kind = "hot-row"         // a transaction holds the busiest balance rows, as a poison event hanging on them would
	Prune          Kind = "prune"           // idem prune during load: the cut, and the wait for the claims begun before it
)

// Describe says what each kind does, for --help.
var Describe = map[Kind]string{
	ConsumerKill:   "SIGKILL a random consumer; a supervisor restarts it",
	CrashPoint:     "restart a consumer armed to SIGKILL itself at a named step (every step in turn)",
	RedisKill:      "SIGKILL the run's redis-server (every key lost), restart it seconds later",
	RedisPause:     "CLIENT PAUSE ALL: Redis answers nothing for up to 3s",
	RedisSlow:      "DEBUG SLEEP in a loop: Redis answers 20-200ms late for seconds",
	RedisFlush:     "FLUSHALL: every lease and done marker lost",
	RedisEvict:     "maxmemory 256kb above its use, allkeys-random: Redis evicts as it is written to",
	PGTerminate:    "pg_terminate_backend on every consumer session",
	PGRestart:      "stop the run's PostgreSQL in immediate mode, start it seconds later",
	PGFailover:     "the run's PostgreSQL is a primary and a streaming standby (synchronous; --async-standby: asynchronous): cut the standby off, kill the primary 0.5-3s later (asynchronous: once it committed 10 rows the standby lacks, up to 10s more), promote the standby, re-point the links, give it a new standby; the commits the old primary had that the new one lacks are named (with --cluster: shard 0)",
	AMQPClose:      "close the consumers' consume and relay connections at the proxy in front of the broker, found by connection name (their publishing connections are left alone)",
	PGBlackhole:    "one consumer's links to PostgreSQL, or all, forward nothing and close nothing for seconds; healing closes the connections they silenced",
	PGReset:        "one consumer's links to PostgreSQL, or all, close each connection as data flows on it, for 300ms",
	PGLatency:      "one consumer's links to PostgreSQL, or all, delay every chunk 100-300ms (± a third) each way for seconds",
	RedisBlackhole: "pg-blackhole on the links to Redis (not with --cluster: cluster clients reach the nodes at the addresses they announce)",
	RedisReset:     "pg-reset on the links to Redis (not with --cluster)",
	RedisLatency:   "pg-latency on the links to Redis (not with --cluster)",
	AMQPBlackhole:  "pg-blackhole on the links to the broker: consume, publishing and relay connections",
	AMQPReset:      "pg-reset on the links to the broker",
	RabbitKill:     "--cluster only: SIGKILL the RabbitMQ node that holds the most of the fleet's consuming connections (the first partition queue's leader on a tie, or if none is seen within 10s), restart it seconds later",
	HTTPFail:       "second hop: the API answers 503 for seconds",
	HTTPSlow:       "second hop: the API acts on each request but answers only after the relay's timeout, for seconds",
	HTTP401:        "second hop: the API answers 401 to every request for seconds, as after a credential rotated under the relays: they pause the destination (no attempt spent), probe it with one row and resume by themselves; not one row may go dead",
	QueueDelete:    "second hop: delete one receipts partition queue with the messages in it (as an operator's mistake would), under the relays that publish to it and the consumers that consume it; the consumers declare it again, the relays pause or retry what the broker returns meanwhile, and once it is back the run resends, as `idem outbox resend` does, the receipts rows sent since the run began: the receipts consumers drop the ones they had. No row may go dead and no receipt may be lost",
	RelayCut:       "second hop: cut a broker connection mid-pass, at a relay's basic.publish or before its confirm (the fleet reaches the broker through an AMQP-aware proxy)",
	APIBlackhole:   "second hop: pg-blackhole on one receipts consumer's link to the API, or all: its relay's POSTs hang until their timeout",
	HotRow:         "a transaction locks the three balance rows updated last on every shard and holds them for seconds, up to the consumers' handler timeout, as a poison event that takes a hot row and hangs until its timeout would: the events queued on them wait, and the kill switch must not count that",
	Prune:          "idem prune on every shard, at the retention the consumers recorded: it records its cut, then waits for every claim begun before it; the kill switch must not count the wait",
}

// Kinds lists every fault kind.
var Kinds = []Kind{ConsumerKill, CrashPoint, RedisKill, RedisPause, RedisSlow, RedisFlush,
	RedisEvict, PGTerminate, PGRestart, PGFailover, AMQPClose, PGBlackhole, PGReset, PGLatency,
	RedisBlackhole, RedisReset, RedisLatency, AMQPBlackhole, AMQPReset, HotRow, Prune,
	RabbitKill, HTTPFail, HTTPSlow, HTTP401, QueueDelete, RelayCut, APIBlackhole}

// TwoHopOnly are the kinds that need the second hop: "all" leaves them out
// of a run without it.
var TwoHopOnly = []Kind{HTTPFail, HTTPSlow, HTTP401, QueueDelete, RelayCut, APIBlackhole}

// ClusterOnly are the kinds that need --cluster: "all" leaves them out of a
// run on one node.
var ClusterOnly = []Kind{RabbitKill}

// SingleNodeOnly are the kinds a --cluster run cannot inject: "all" leaves
// them out of it. Its Redis stays direct (see startLinks).
var SingleNodeOnly = []Kind{RedisBlackhole, RedisReset, RedisLatency}

func (k Kind) consumerFault() bool { return k == ConsumerKill || k == CrashPoint }

// linkFault reports whether k is a toxic on the consumers' links.
func (k Kind) linkFault() bool {
	switch k {
	case PGBlackhole, PGReset, PGLatency, RedisBlackhole, RedisReset, RedisLatency, AMQPBlackhole, AMQPReset, APIBlackhole:
		return true
	}
	return false
}

// ParseKinds parses a comma-separated list of kinds; "all" is every kind
// (but the ClusterOnly ones unless cluster is set, the SingleNodeOnly ones
// if it is, and the TwoHopOnly ones unless twoHop is).
func ParseKinds(s string, cluster, twoHop bool) ([]Kind, error) {
	if s == "" || s == "all" {
		return slices.DeleteFunc(slices.Clone(Kinds), func(k Kind) bool {
			return (!cluster && slices.Contains(ClusterOnly, k)) || (cluster && slices.Contains(SingleNodeOnly, k)) ||
				(!twoHop && slices.Contains(TwoHopOnly, k))
		}), nil
	}
	var out []Kind
	for _, f := range strings.Split(s, ",") {
		k := Kind(strings.TrimSpace(f))
		if !slices.Contains(Kinds, k) {
			return nil, fmt.Errorf("unknown fault kind %q (want all, or some of %s)", k, kindList())
		}
		if !slices.Contains(out, k) {
			out = append(out, k)
		}
	}
	return out, nil
}

func kindList() string {
	s := make([]string, len(Kinds))
	for i, k := range Kinds {
		s[i] = string(k)
	}
	return strings.Join(s, ",")
}

// Planned is one fault of the schedule.
type Planned struct {
	Kind Kind          `json:"kind"`
	At   time.Duration `json:"at"`            // from the start of publishing
	For  time.Duration `json:"for,omitempty"` // how long the fault lasts (0: instant)
	// Slot is the consumer a consumer fault hits, or whose links a link
	// fault hits unless All.
	Slot int    `json:"slot,omitempty"`
	All  bool   `json:"all,omitempty"`  // link faults: every consumer's links
	Step string `json:"step,omitempty"` // crash-point: where it dies
	// After is how many passes of Step the armed consumer makes before it dies.
	After int `json:"after,omitempty"`
	// Lag is how late redis-slow's Redis answers, or how late a latency
	// fault's links forward each chunk.
	Lag time.Duration `json:"lag,omitempty"`
}

// resetFor is how long a reset kind's toxic stays on.
const resetFor = 300 * time.Millisecond

// Plan draws the fault schedule of a run from its seed: three tracks over
// the first 85% of the publishing time. The consumer track kills consumers
// (slots 0 to consumers-1), and arms crash points in turn at every one of
// steps. The infrastructure track runs one fault at a time, every enabled
// kind once per round in a shuffled order, for as many rounds as fit (at
// least one). The API track (second hop) takes its kinds in turn, about one
// every 15 seconds. A link fault hits one consumer's links or, as often,
// every consumer's.
func Plan(seed uint64, d time.Duration, consumers int, kinds []Kind, steps []string) []Planned {
	allSteps := steps
	rng := rand.New(rand.NewPCG(seed, 0xc4a05))
	between := func(lo, hi time.Duration) time.Duration { return lo + time.Duration(rng.Int64N(int64(hi-lo)+1)) }
	target := func(p *Planned) {
		if p.Kind.linkFault() {
			p.Slot = rng.IntN(consumers)
			p.All = rng.IntN(2) == 0
		}
	}
	var plan []Planned
	start, end := d/10, d*85/100

	// Consumer track: one fault every few seconds; crash points cycle
	// through every step (shuffled per cycle), with a plain kill every
	// third fault.
	var cons []Kind
	for _, k := range kinds {
		if k.consumerFault() {
			cons = append(cons, k)
		}
	}
	if len(cons) > 0 {
		// Every third fault is a plain kill: enough faults that the
		// crash points cover every step.
		n := len(allSteps)
		for n-(n+1)/3 < len(allSteps) {
			n++
		}
		n = max(n, int((end-start)/(6*time.Second)))
		gap := (end - start) / time.Duration(n)
		var steps []string
		slot := -1
		for i := range n {
			// Never the slot hit last: an armed consumer gets time to die
			// at its step before it could be killed again.
			next := rng.IntN(consumers)
			if consumers > 1 && next == slot {
				next = (next + 1 + rng.IntN(consumers-1)) % consumers
			}
			slot = next
			p := Planned{Kind: cons[0], At: start + time.Duration(i)*gap + between(0, gap/2), Slot: slot}
			if len(cons) == 2 && i%3 == 2 {
				p.Kind = ConsumerKill
			} else if len(cons) == 2 {
				p.Kind = CrashPoint
			}
			if p.Kind == CrashPoint {
				if len(steps) == 0 {
					steps = slices.Clone(allSteps)
					rng.Shuffle(len(steps), func(i, j int) { steps[i], steps[j] = steps[j], steps[i] })
				}
				p.Step, steps = steps[0], steps[1:]
				p.After = 1 + rng.IntN(20)
				if slices.Contains(step.Relay, p.Step) {
					// A relay reaches its steps once per pass that found
					// rows, and shares the rows with every other relay;
					// armed late in the stream, it may find rows only a
					// few times before the stream ends: its first or
					// second pass.
					p.After = 1 + rng.IntN(2)
				}
			}
			plan = append(plan, p)
		}
	}

	// The API's track: its faults touch nothing the infrastructure track
	// does, so they run beside it, spread over the stream.
	var api []Kind
	for _, k := range kinds {
		if slices.Contains(TwoHopOnly, k) {
			api = append(api, k)
		}
	}
	if len(api) > 0 {
		n := max(len(api), int((end-start)/(15*time.Second)))
		gap := (end - start) / time.Duration(n)
		for i := range n {
			p := Planned{Kind: api[i%len(api)], At: start + time.Duration(i)*gap + between(0, gap/3)}
			p.For = between(2*time.Second, min(5*time.Second, gap/2))
			target(&p)
			plan = append(plan, p)
		}
	}

	// Infrastructure track.
	var infra []Kind
	for _, k := range kinds {
		if !k.consumerFault() && !slices.Contains(TwoHopOnly, k) {
			infra = append(infra, k)
		}
	}
	// Each round takes every kind once in a shuffled order. The faults
	// that wait on a slow outside command go last in their round, so that
	// their delay does not push the round's timed faults (the Redis ones
	// that must open a breaker) past the stream: a killed RabbitMQ node
	// takes twenty seconds or so to boot again.
	// A failover also waits for a base backup (its new standby).
	slow := []Kind{PGFailover, RabbitKill}
	at := start
	for round := 0; len(infra) > 0 && (round == 0 || at < end); round++ {
		order := slices.Clone(infra)
		rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
		for _, k := range slow {
			if i := slices.Index(order, k); i >= 0 {
				order = append(slices.Delete(order, i, i+1), k)
			}
		}
		var faults []Planned
		for _, k := range order {
			p := Planned{Kind: k}
			switch k {
			case RedisKill, RedisEvict, PGRestart, RabbitKill:
				p.For = between(2*time.Second, 6*time.Second)
			case RedisPause:
				p.For = between(500*time.Millisecond, 3*time.Second)
			case RedisSlow:
				p.For = between(2*time.Second, 5*time.Second)
				p.Lag = between(20*time.Millisecond, 200*time.Millisecond)
			case PGBlackhole, RedisBlackhole, AMQPBlackhole:
				p.For = between(2*time.Second, 5*time.Second)
			case PGLatency, RedisLatency:
				p.For = between(2*time.Second, 5*time.Second)
				p.Lag = between(100*time.Millisecond, 300*time.Millisecond)
			case PGReset, RedisReset, AMQPReset:
				p.For = resetFor
			case HotRow:
				// Below the consumers' handler timeout (10s), the longest a
				// poison event holds what it took.
				p.For = between(2*time.Second, 8*time.Second)
			case PGFailover:
				// How long the primary lives on with its standby cut off.
				p.For = between(500*time.Millisecond, 3*time.Second)
			}
			target(&p)
			faults = append(faults, p)
		}
		gaps := make([]time.Duration, len(faults))
		for i := range gaps {
			gaps[i] = between(time.Second, 3*time.Second)
		}
		// The first round must fit in the stream, or its last faults
		// would hit an idle fleet: shortened in proportion (fitRound).
		if round == 0 {
			fitRound(faults, gaps, end-start)
		}
		for i, p := range faults {
			if round > 0 && at >= end {
				break
			}
			p.At = at
			plan = append(plan, p)
			at += p.For + gaps[i]
		}
	}
	slices.SortStableFunc(plan, func(a, b Planned) int { return int(a.At - b.At) })
	return plan
}

// fitRound shortens a round's fault durations and the gaps after them, so
// that the round takes no more than room: each keeps a floor (a fault a
// second, or what it drew if less; a gap half a second, or what it drew if
// less), and what is above the floors shrinks in proportion. If the floors
// alone take more than room, everything is at its floor.
func fitRound(faults []Planned, gaps []time.Duration, room time.Duration) {
	var total, floors time.Duration
	for i, p := range faults {
		total += p.For + gaps[i]
		floors += min(p.For, time.Second) + min(gaps[i], 500*time.Millisecond)
	}
	if total <= room || total == floors {
		return
	}
	above, keep := total-floors, max(0, room-floors)
	shrink := func(d, floor time.Duration) time.Duration {
		floor = min(d, floor)
		return floor + time.Duration(float64(d-floor)*float64(keep)/float64(above))
	}
	for i := range faults {
		faults[i].For = shrink(faults[i].For, time.Second)
		gaps[i] = shrink(gaps[i], 500*time.Millisecond)
	}
}
