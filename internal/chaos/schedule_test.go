package chaos

import (
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/crashpoint"
)

func TestPlanIsSeededAndCoversEveryKind(t *testing.T) {
	a := Plan(7, 40*time.Second, 4, Kinds, crashpoint.Steps)
	require.Equal(t, a, Plan(7, 40*time.Second, 4, Kinds, crashpoint.Steps), "the same seed must give the same schedule")
	require.NotEqual(t, a, Plan(8, 40*time.Second, 4, Kinds, crashpoint.Steps))

	kinds, steps := map[Kind]int{}, map[string]int{}
	last := -1
	for i, p := range a {
		kinds[p.Kind]++
		if i > 0 {
			require.GreaterOrEqual(t, p.At, a[i-1].At, "sorted by time")
		}
		if p.Kind.consumerFault() {
			require.NotEqual(t, last, p.Slot, "the same consumer twice in a row")
			last = p.Slot
		}
		if p.Kind == CrashPoint {
			steps[p.Step]++
			require.Positive(t, p.After)
		}
	}
	for _, k := range Kinds {
		require.Positive(t, kinds[k], "kind %s missing", k)
	}
	for _, s := range crashpoint.Steps {
		require.Positive(t, steps[string(s)], "crash point %s never armed", s)
	}
}

func TestPlanOnlyTheKindsAsked(t *testing.T) {
	for _, p := range Plan(1, time.Minute, 3, []Kind{RedisFlush}, crashpoint.Steps) {
		require.Equal(t, RedisFlush, p.Kind)
	}
	long := Plan(1, 10*time.Minute, 3, []Kind{RedisKill, ConsumerKill}, crashpoint.Steps)
	n := map[Kind]int{}
	for _, p := range long {
		n[p.Kind]++
	}
	require.Greater(t, n[RedisKill], 10, "a long run repeats faults")
	require.Greater(t, n[ConsumerKill], 10)
}

// TestSlowFaultsEndEachRound: rabbit-kill, which waits on a node's slow
// boot, comes after the other infrastructure faults of its round, whatever
// the seed. (amqp-close, done by a proxy in milliseconds, no longer does.)
func TestSlowFaultsEndEachRound(t *testing.T) {
	kinds := []Kind{RedisKill, AMQPClose, PGRestart, PGTerminate, RabbitKill, ConsumerKill}
	amqpCloseLast := 0
	for seed := range uint64(50) {
		var infra []Kind
		for _, p := range Plan(seed, 40*time.Second, 3, kinds, crashpoint.Steps) {
			if !p.Kind.consumerFault() {
				infra = append(infra, p.Kind)
			}
		}
		require.Equal(t, RabbitKill, infra[4], "seed %d: %v", seed, infra)
		if infra[3] == AMQPClose {
			amqpCloseLast++
		}
	}
	require.Less(t, amqpCloseLast, 50, "amqp-close is shuffled with the others")
}

// TestFirstRoundFitsInTheStream: every timed fault of the first round ends
// while events still flow (before 85% of the stream), whatever the seed;
// a Redis kill drawn last once came after the stream, and no breaker
// opened. TestChaosCI's 40 seconds must hold every infrastructure kind.
func TestFirstRoundFitsInTheStream(t *testing.T) {
	kinds, err := ParseKinds("all", false, true)
	require.NoError(t, err)
	var infra []Kind
	for _, k := range kinds {
		if !k.consumerFault() && !slices.Contains(TwoHopOnly, k) {
			infra = append(infra, k)
		}
	}
	require.Len(t, infra, 19)
	d := 40 * time.Second
	for seed := range uint64(500) {
		seen := map[Kind]bool{}
		for _, p := range Plan(seed, d, 6, kinds, crashpoint.Steps) {
			if p.Kind.consumerFault() || slices.Contains(TwoHopOnly, p.Kind) || seen[p.Kind] {
				continue
			}
			seen[p.Kind] = true
			require.GreaterOrEqual(t, p.At, d/10, "seed %d: %s before the stream", seed, p.Kind)
			require.LessOrEqual(t, p.At+p.For, d*85/100, "seed %d: %s ends after the stream", seed, p.Kind)
			if p.For > 0 {
				floor := time.Second
				switch p.Kind {
				case RedisPause, PGFailover:
					floor = 500 * time.Millisecond
				case PGReset, RedisReset, AMQPReset:
					floor = resetFor
				}
				require.GreaterOrEqual(t, p.For, floor, "seed %d: %s", seed, p.Kind)
			}
		}
		require.Len(t, seen, len(infra), "seed %d: every infrastructure kind once in the first round", seed)
	}
}

// TestAPITrackHoldsEveryKind: in TestChaosCI's 40 seconds the API track
// injects each of its kinds, api-blackhole included, whatever the seed.
func TestAPITrackHoldsEveryKind(t *testing.T) {
	kinds, err := ParseKinds("all", false, true)
	require.NoError(t, err)
	d := 40 * time.Second
	for seed := range uint64(200) {
		seen := map[Kind]bool{}
		for _, p := range Plan(seed, d, 6, kinds, crashpoint.Steps) {
			if slices.Contains(TwoHopOnly, p.Kind) {
				seen[p.Kind] = true
				require.LessOrEqual(t, p.At+p.For, d*85/100, "seed %d: %s ends after the stream", seed, p.Kind)
			}
		}
		require.Len(t, seen, len(TwoHopOnly), "seed %d", seed)
	}
}

// TestLinkFaults: a link fault hits one consumer's links (a slot of the
// run) or every consumer's, both drawn; resets are brief, latencies
// 100-300ms, blackholes and latencies last seconds.
func TestLinkFaults(t *testing.T) {
	one, all := 0, 0
	for seed := range uint64(50) {
		for _, p := range Plan(seed, 10*time.Minute, 6, Kinds, crashpoint.Steps) {
			if !p.Kind.linkFault() {
				require.False(t, p.All, "%s", p.Kind)
				continue
			}
			require.GreaterOrEqual(t, p.Slot, 0)
			require.Less(t, p.Slot, 6)
			if p.All {
				all++
			} else {
				one++
			}
			switch p.Kind {
			case PGReset, RedisReset, AMQPReset:
				require.Equal(t, resetFor, p.For)
			case PGLatency, RedisLatency:
				require.GreaterOrEqual(t, p.Lag, 100*time.Millisecond)
				require.LessOrEqual(t, p.Lag, 300*time.Millisecond)
				require.GreaterOrEqual(t, p.For, 2*time.Second)
			default:
				require.GreaterOrEqual(t, p.For, 2*time.Second)
				require.LessOrEqual(t, p.For, 5*time.Second)
			}
		}
	}
	require.Positive(t, one)
	require.Positive(t, all)
}

// TestFitRound: a round that does not fit is shortened to take room
// exactly (give or take rounding), each duration and gap keeping its
// floor; a round that fits is left alone.
func TestFitRound(t *testing.T) {
	total := func(f []Planned, g []time.Duration) (d time.Duration) {
		for i := range f {
			d += f[i].For + g[i]
		}
		return d
	}
	f := []Planned{{For: 6 * time.Second}, {For: resetFor}, {}, {For: 2 * time.Second}}
	g := []time.Duration{3 * time.Second, time.Second, 400 * time.Millisecond, 3 * time.Second}
	fitRound(f, g, 8*time.Second)
	require.InDelta(t, float64(8*time.Second), float64(total(f, g)), float64(time.Millisecond))
	require.LessOrEqual(t, total(f, g), 8*time.Second)
	require.Equal(t, resetFor, f[1].For, "a fault shorter than a second keeps what it drew")
	require.Zero(t, f[2].For)
	require.Equal(t, 400*time.Millisecond, g[2], "a gap shorter than its floor keeps what it drew")
	require.GreaterOrEqual(t, f[3].For, time.Second)
	require.GreaterOrEqual(t, g[1], 500*time.Millisecond)

	fitRound(f, g, time.Second) // less than the floors: everything at its floor
	require.Equal(t, []Planned{{For: time.Second}, {For: resetFor}, {}, {For: time.Second}}, f)
	require.Equal(t, []time.Duration{500 * time.Millisecond, 500 * time.Millisecond, 400 * time.Millisecond, 500 * time.Millisecond}, g)

	g2 := slices.Clone(g)
	fitRound(f, g, time.Minute)
	require.Equal(t, g2, g, "a round that fits is left alone")
}

func TestParseKinds(t *testing.T) {
	all, err := ParseKinds("all", false, false)
	require.NoError(t, err)
	require.Equal(t, Kinds[:len(Kinds)-len(TwoHopOnly)-1], all, "all but the cluster-only and two-hop kinds")
	require.NotContains(t, all, RabbitKill)
	require.Contains(t, all, RedisBlackhole)
	all, err = ParseKinds("all", true, true)
	require.NoError(t, err)
	require.Equal(t, slices.DeleteFunc(slices.Clone(Kinds), func(k Kind) bool { return slices.Contains(SingleNodeOnly, k) }), all,
		"all but the Redis link kinds: a cluster's Redis is reached directly")
	require.Contains(t, all, RabbitKill)
	all, err = ParseKinds("all", false, true)
	require.NoError(t, err)
	require.Contains(t, all, HTTPFail)
	require.Contains(t, all, APIBlackhole)
	require.Contains(t, all, RedisLatency)
	require.NotContains(t, all, RabbitKill)
	got, err := ParseKinds("redis-kill, pg-restart,redis-kill", false, false)
	require.NoError(t, err)
	require.Equal(t, []Kind{RedisKill, PGRestart}, got)
	_, err = ParseKinds("redis-kill,meteor", false, false)
	require.ErrorContains(t, err, `unknown fault kind "meteor"`)
}

// TestEveryKindIsDescribed: --help lists each kind with a line.
func TestEveryKindIsDescribed(t *testing.T) {
	for _, k := range Kinds {
		require.NotEmpty(t, Describe[k], k)
	}
	require.Len(t, Describe, len(Kinds))
}

func TestBreakerStateFromTransitionCounts(t *testing.T) {
	st := func(kv ...any) map[string]int64 {
		m := map[string]int64{}
		for i := 0; i < len(kv); i += 2 {
			m["breaker/"+kv[i].(string)] = int64(kv[i+1].(int))
		}
		return m
	}
	require.Equal(t, "closed", breakerState(st()))
	require.Equal(t, "open", breakerState(st("closed->open", 1)))
	require.Equal(t, "half-open", breakerState(st("closed->open", 1, "open->half-open", 1)))
	require.Equal(t, "open", breakerState(st("closed->open", 1, "open->half-open", 1, "half-open->open", 1)))
	require.Equal(t, "closed", breakerState(st("closed->open", 2, "open->half-open", 3, "half-open->open", 1, "half-open->closed", 2)))
}

// TestEveryKindHasAColour: the report's key and fault windows colour each
// kind; one without a colour had no swatch (rabbit-kill did not).
func TestEveryKindHasAColour(t *testing.T) {
	for _, k := range Kinds {
		require.NotEmpty(t, kindColor[k], k)
	}
}

// TestACrashPointNotSeenYetTakesTheTurnOfOneSeen: the plan arms each step
// once; when a step has fired already, or a consumer armed at it still
// runs, its turn goes to a step that has not fired; so does a plain kill's,
// once one plain kill was injected. Nothing changes once every step fired.
func TestACrashPointNotSeenYetTakesTheTurnOfOneSeen(t *testing.T) {
	steps := []string{"a", "b", "c"}
	r := &run{steps: steps, fleet: &consumers{armed: map[int]armed{}}}
	r.fleet.crashes = []CrashRecord{{Step: "a"}}

	require.Equal(t, Planned{Kind: CrashPoint, Step: "c", After: 7}, r.retarget(Planned{Kind: CrashPoint, Step: "c", After: 7}),
		"a step not seen keeps its turn")
	require.Equal(t, Planned{Kind: CrashPoint, Step: "b", After: 1}, r.retarget(Planned{Kind: CrashPoint, Step: "a", After: 7}),
		"a step seen gives its turn to the first not seen")
	require.Equal(t, Planned{Kind: ConsumerKill, Slot: 2}, r.retarget(Planned{Kind: ConsumerKill, Slot: 2}),
		"the first plain kill stays a kill")
	r.faults = []Fault{{Kind: ConsumerKill}}
	require.Equal(t, Planned{Kind: CrashPoint, Slot: 2, Step: "b", After: 1}, r.retarget(Planned{Kind: ConsumerKill, Slot: 2}),
		"a later plain kill arms a step not seen")
	require.Equal(t, Planned{Kind: RedisKill}, r.retarget(Planned{Kind: RedisKill}), "other kinds are left alone")

	r.fleet.crashes = append(r.fleet.crashes, CrashRecord{Step: "b"}, CrashRecord{Step: "c"})
	require.Equal(t, Planned{Kind: ConsumerKill}, r.retarget(Planned{Kind: ConsumerKill}), "every step fired")
	require.Equal(t, Planned{Kind: CrashPoint, Step: "a", After: 3}, r.retarget(Planned{Kind: CrashPoint, Step: "a", After: 3}))
}
