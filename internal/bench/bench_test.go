package bench

import (
	"bytes"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/roundtrip"
)

func TestMediansAndRatios(t *testing.T) {
	require.Equal(t, 2.0, median([]float64{3, 1, 2}))
	require.Equal(t, 2.5, median([]float64{4, 1, 2, 3}))
	require.Equal(t, 0.003, percentile([]int64{5, 1, 3, 2, 4}, 0.5))
	require.Equal(t, 0.005, percentile([]int64{5, 1, 3, 2, 4}, 0.99))

	rows := Rows(0)
	raw, _ := Find(nil, "x")
	require.Zero(t, raw.Rate)
	results := []Result{
		summarize(rows[0], []runResult{{Rate: 100}, {Rate: 300}, {Rate: 200}}),
		summarize(rows[3], []runResult{{Rate: 50, Doubled: 1}, {Rate: 70}, {Rate: 60, Missing: 2}}),
	}
	ratios(results)
	require.Equal(t, 200.0, results[0].Rate)
	require.Equal(t, 0.3, results[1].Ratio, "batched over raw, medians of each")
	require.Equal(t, 1, results[1].Doubled, "doubles add up over runs")
	require.Equal(t, 2, results[1].Missing)

	var out bytes.Buffer
	Print(&out, results)
	require.Contains(t, out.String(), "| batched, Redis on, 0% | 60 | 0.30× raw 0% |")
	out.Reset()
	Chart(&out, results)
	require.True(t, strings.HasPrefix(out.String(), "<svg"), out.String())
}

func TestEveryRowHasItsBaseline(t *testing.T) {
	names := map[string]bool{}
	for _, r := range Rows(time.Millisecond) {
		require.False(t, names[r.Name], "%s: two rows of that name", r.Name)
		names[r.Name] = true
	}
	for _, r := range Rows(time.Millisecond) {
		require.True(t, names[r.Baseline], "%s: baseline %q is not a row", r.Name, r.Baseline)
		require.Positive(t, r.Procs, r.Name)
	}
	remote := slices.DeleteFunc(Rows(3*time.Millisecond), func(r Row) bool { return r.PGLatency == 0 })
	require.Len(t, remote, 8)
	require.Equal(t, "per-event, Redis on, 25%, Postgres 3 ms away", remote[0].Name)
	require.Equal(t, "per-event, Redis on, 25%", remote[0].Baseline, "a remote row is compared with the same row beside Postgres")
	require.Len(t, Rows(0), len(Rows(time.Millisecond))-8)
}

func TestBuildsTakeTurnsToGoFirst(t *testing.T) {
	raw, on, off := Row{Name: "raw"}, Row{Name: "on"}, Row{Name: "off"}
	all := []*series{
		{row: raw},
		{row: on}, {row: on, build: BuildBaseline},
		{row: off}, {row: off, build: BuildBaseline},
	}
	labels := func(run int) []string {
		var out []string
		for _, s := range runOrder(all, run) {
			out = append(out, s.label())
		}
		return out
	}
	this := []string{"raw", "on", "on (baseline)", "off", "off (baseline)"}
	swapped := []string{"raw", "on (baseline)", "on", "off (baseline)", "off"}
	require.Equal(t, this, labels(0))
	require.Equal(t, swapped, labels(1))
	require.Equal(t, this, labels(2))
	require.Equal(t, swapped, labels(3))
	require.Equal(t, "on", all[1].label(), "runOrder leaves all as it was")
}

func TestBaselineCausesAndRedisTables(t *testing.T) {
	rows := map[string]Row{}
	for _, r := range Rows(time.Millisecond) {
		rows[r.Name] = r
	}
	on, off := "batched, Redis on, 25%, Postgres 1 ms away", "batched, Redis off, 25%, Postgres 1 ms away"
	res := func(name, build string, rates ...float64) Result {
		var runs []runResult
		for _, rate := range rates {
			runs = append(runs, runResult{Rate: rate, PGTrips: 0.02, StartupMs: rate / 2, PGCauses: map[roundtrip.Cause]CauseCost{
				roundtrip.CauseClaim: {Trips: 0.005, WaitMicros: 40}, roundtrip.CauseCommit: {Trips: 0.005, WaitMicros: 30}}})
		}
		r := summarize(rows[name], runs)
		r.Build = build
		return r
	}
	results := []Result{
		res(on, "", 100, 200, 300),
		res(on, BuildBaseline, 50, 400, 150), // per run 2, 0.5, 2: median 2, where the medians' ratio is 1.33
		res(off, "", 100, 100, 100),
		res(off, BuildBaseline, 100, 100, 200),
	}
	results[1].PGByCause = nil // a baseline that does not report causes
	require.Equal(t, 2.0, runRatio(results[0].RateRuns, results[1].RateRuns))
	ratios(results)
	require.Zero(t, results[0].Ratio, "the co-located row did not run")

	var out bytes.Buffer
	Print(&out, results)
	s := out.String()
	require.Contains(t, s, "| "+on+" | 200 | 150 | 2.000× | 0 vs 0 | 0.020 vs 0.020 | 100 vs 75 |", "start-up: medians of the runs")
	require.Contains(t, s, "| batched | 25% | Postgres 1 ms away | 2.000× | 0.750× |", "on/off per run: this 1, 2, 3; baseline 0.5, 4, 0.75")
	require.Contains(t, s, "| "+on+" | – | 0.005 · 40 | – | – | – | 0.005 · 30 | – | – | – | – | 0.010 · 70 |")
	require.NotContains(t, s, on+" (baseline) |", "no cause row for a baseline that does not report them")
	require.Contains(t, s, off+" ("+BuildBaseline+") | – | 0.005 · 40 |")
	require.Equal(t, 1, strings.Count(s, "| "+on+" | 200 | – |"), "the main table shows this build's rows only")
}

func TestCPUOfThisProcess(t *testing.T) {
	comm, secs, ok := readStat(os.Getpid())
	require.True(t, ok)
	require.NotEmpty(t, comm)
	require.GreaterOrEqual(t, secs, 0.0)
	before := map[Tier]cpuSample{TierConsumer: {1: 1.0}}
	after := map[Tier]cpuSample{TierConsumer: {1: 1.5, 2: 0.25}}
	require.Equal(t, 0.75, cpuDelta(before, after)[TierConsumer], "a process started in between counts from zero")
	for comm, tier := range map[string]Tier{"postgres": TierPostgres, "beam.smp": TierRabbitMQ, "redis-server": TierRedis} {
		got, ok := serviceOf(comm)
		require.True(t, ok, comm)
		require.Equal(t, tier, got)
	}
	_, ok = serviceOf("bash")
	require.False(t, ok)
	require.Positive(t, peakRSS(os.Getpid()))
}
