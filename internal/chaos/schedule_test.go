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

// TestSlowFaultsEndEachRound: rabbit-kill and amqp-close, which wait on
// slow outside commands, come after the other infrastructure faults of
// their round, whatever the seed.
func TestSlowFaultsEndEachRound(t *testing.T) {
	kinds := []Kind{RedisKill, AMQPClose, PGRestart, PGTerminate, RabbitKill, ConsumerKill}
	for seed := range uint64(50) {
		var infra []Kind
		for _, p := range Plan(seed, 40*time.Second, 3, kinds, crashpoint.Steps) {
			if !p.Kind.consumerFault() {
				infra = append(infra, p.Kind)
			}
		}
		require.Equal(t, []Kind{AMQPClose, RabbitKill}, infra[3:5], "seed %d: %v", seed, infra)
	}
}

// TestFirstRoundFitsInTheStream: every timed fault of the first round ends
// while events still flow (before 85% of the stream), whatever the seed;
// a Redis kill drawn last once came after the stream, and no breaker
// opened.
func TestFirstRoundFitsInTheStream(t *testing.T) {
	kinds, err := ParseKinds("all", false, true)
	require.NoError(t, err)
	d := 40 * time.Second
	for seed := range uint64(200) {
		seen := map[Kind]bool{}
		for _, p := range Plan(seed, d, 4, kinds, crashpoint.Steps) {
			if p.Kind.consumerFault() || slices.Contains(TwoHopOnly, p.Kind) || seen[p.Kind] {
				continue
			}
			seen[p.Kind] = true
			if p.Kind != AMQPClose {
				require.LessOrEqual(t, p.At+p.For, d*85/100, "seed %d: %s ends after the stream", seed, p.Kind)
			}
			if p.For > 0 {
				floor := time.Second
				if p.Kind == RedisPause {
					floor = 500 * time.Millisecond
				}
				require.GreaterOrEqual(t, p.For, floor, "seed %d: %s", seed, p.Kind)
			}
		}
		require.Len(t, seen, 8, "seed %d: every infrastructure kind once in the first round", seed)
	}
}

func TestParseKinds(t *testing.T) {
	all, err := ParseKinds("all", false, false)
	require.NoError(t, err)
	require.Equal(t, Kinds[:len(Kinds)-4], all, "all but the cluster-only and two-hop kinds")
	require.NotContains(t, all, RabbitKill)
	all, err = ParseKinds("all", true, true)
	require.NoError(t, err)
	require.Equal(t, Kinds, all)
	all, err = ParseKinds("all", false, true)
	require.NoError(t, err)
	require.Contains(t, all, HTTPFail)
	require.NotContains(t, all, RabbitKill)
	got, err := ParseKinds("redis-kill, pg-restart,redis-kill", false, false)
	require.NoError(t, err)
	require.Equal(t, []Kind{RedisKill, PGRestart}, got)
	_, err = ParseKinds("redis-kill,meteor", false, false)
	require.ErrorContains(t, err, `unknown fault kind "meteor"`)
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
