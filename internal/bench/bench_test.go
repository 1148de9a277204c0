package bench

import (
	"bytes"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestMediansAndRatios(t *testing.T) {
	require.Equal(t, 2.0, median([]float64{3, 1, 2}))
	require.Equal(t, 2.5, median([]float64{4, 1, 2, 3}))
	require.Equal(t, 0.003, percentile([]int64{5, 1, 3, 2, 4}, 0.5))
	require.Equal(t, 0.005, percentile([]int64{5, 1, 3, 2, 4}, 0.99))

	rows := Rows()
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
	for _, r := range Rows() {
		names[r.Name] = true
	}
	for _, r := range Rows() {
		require.True(t, names[r.Baseline], "%s: baseline %q is not a row", r.Name, r.Baseline)
		require.Positive(t, r.Procs, r.Name)
	}
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
