package bench

import (
	"fmt"
	"html"
	"io"
	"slices"
	"strings"

	"github.com/idemhq/idem/internal/roundtrip"
)

// Result is a row's medians over its runs.
type Result struct {
	Row Row `json:"row"`
	// Build is "" for the rows run with this build's workers, and
	// BuildBaseline for those run with Options.BaselineBin's.
	Build string `json:"build,omitempty"`
	Runs  int    `json:"runs"`
	// Rate is messages settled per second, and RateRuns each run's.
	Rate     float64   `json:"rate"`
	RateRuns []float64 `json:"rateRuns"`
	// Ratio is Rate over the Rate of the row's Baseline.
	Ratio float64 `json:"ratio"`
	// CPU is CPU time per message by tier, in microseconds.
	CPU CPU `json:"cpuMicros"`
	// PGTrips and RedisTrips are round trips per message.
	PGTrips    float64 `json:"postgresTripsPerMessage"`
	RedisTrips float64 `json:"redisTripsPerMessage"`
	// PGByCause splits PGTrips by cause, with the time waited on them;
	// empty for workers of a build that does not report it.
	PGByCause map[roundtrip.Cause]CauseCost `json:"postgresByCause,omitempty"`
	// RSSMB is the largest consumer peak RSS of any run, in MiB.
	RSSMB float64 `json:"rssMiB"`
	// Errors is requeues and dead letters, and Breaker the breaker's
	// transitions, over all runs.
	Errors  int64 `json:"errors"`
	Breaker int64 `json:"breakerTransitions"`
	// Doubled and Missing are events applied twice or never, over all runs.
	Doubled int `json:"doubled"`
	Missing int `json:"missing"`
	// P50 and P99 are publish-to-ack latencies in ms (latency row).
	P50 float64 `json:"p50ms,omitempty"`
	P99 float64 `json:"p99ms,omitempty"`
	// Outcomes counts deliveries by outcome, over all runs.
	Outcomes map[string]int64 `json:"outcomes,omitempty"`
	// BytesPerKey is Redis memory per done key.
	BytesPerKey float64 `json:"redisBytesPerKey,omitempty"`
	// StartupMs is the time from a worker's "go" to its consumer's
	// registration on the queue (start-up checks, connections), median of
	// the runs. Rate and CPU are measured from that registration on.
	StartupMs float64 `json:"startupMs,omitempty"`
}

// CauseCost is one cause's Postgres round trips per message and the time
// waited on them per message, in microseconds (summed over connections:
// the waits of concurrent transactions add up).
type CauseCost struct {
	Trips      float64 `json:"tripsPerMessage"`
	WaitMicros float64 `json:"waitMicrosPerMessage"`
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func medianOf(runs []runResult, f func(runResult) float64) float64 {
	v := make([]float64, len(runs))
	for i, r := range runs {
		v[i] = f(r)
	}
	return median(v)
}

func summarize(row Row, runs []runResult) Result {
	res := Result{Row: row, Runs: len(runs)}
	for _, r := range runs {
		res.RateRuns = append(res.RateRuns, r.Rate)
		res.RSSMB = max(res.RSSMB, float64(r.RSS)/(1<<20))
		res.Errors += r.Errors
		res.Breaker += r.Breaker
		res.Doubled += r.Doubled
		res.Missing += r.Missing
		for o, n := range r.Outcomes {
			if res.Outcomes == nil {
				res.Outcomes = map[string]int64{}
			}
			res.Outcomes[o] += n
		}
	}
	res.Rate = median(res.RateRuns)
	res.CPU = CPU{
		Consumer: medianOf(runs, func(r runResult) float64 { return r.CPU.Consumer }),
		Postgres: medianOf(runs, func(r runResult) float64 { return r.CPU.Postgres }),
		RabbitMQ: medianOf(runs, func(r runResult) float64 { return r.CPU.RabbitMQ }),
		Redis:    medianOf(runs, func(r runResult) float64 { return r.CPU.Redis }),
	}
	res.PGTrips = medianOf(runs, func(r runResult) float64 { return r.PGTrips })
	res.RedisTrips = medianOf(runs, func(r runResult) float64 { return r.RedisTrips })
	for _, r := range runs {
		for c := range r.PGCauses {
			if _, done := res.PGByCause[c]; done {
				continue
			}
			if res.PGByCause == nil {
				res.PGByCause = map[roundtrip.Cause]CauseCost{}
			}
			res.PGByCause[c] = CauseCost{
				Trips:      medianOf(runs, func(r runResult) float64 { return r.PGCauses[c].Trips }),
				WaitMicros: medianOf(runs, func(r runResult) float64 { return r.PGCauses[c].WaitMicros }),
			}
		}
	}
	res.P50 = medianOf(runs, func(r runResult) float64 { return r.P50 })
	res.P99 = medianOf(runs, func(r runResult) float64 { return r.P99 })
	res.BytesPerKey = medianOf(runs, func(r runResult) float64 { return r.BytesPerKey })
	res.StartupMs = medianOf(runs, func(r runResult) float64 { return r.StartupMs })
	return res
}

// ratios sets each result's Ratio to its baseline row's of the same build,
// when that row ran; the raw rows run with this build's workers only, and
// serve both builds.
func ratios(results []Result) {
	for i, r := range results {
		base, ok := find(results, r.Build, r.Row.Baseline)
		if !ok {
			base, ok = find(results, "", r.Row.Baseline)
		}
		if ok && base.Rate > 0 {
			results[i].Ratio = r.Rate / base.Rate
		}
	}
}

// Find returns the result of the named row, run with this build's workers.
func Find(results []Result, name string) (Result, bool) { return find(results, "", name) }

func find(results []Result, build, name string) (Result, bool) {
	i := slices.IndexFunc(results, func(r Result) bool { return r.Build == build && r.Row.Name == name })
	if i < 0 {
		return Result{}, false
	}
	return results[i], true
}

// runRatio is the median of the per-run ratios a[i]/b[i]: runs i of two
// rows ran one right after the other, so each ratio shares the machine's
// state of that moment.
func runRatio(a, b []float64) float64 {
	var v []float64
	for i := range min(len(a), len(b)) {
		if b[i] > 0 {
			v = append(v, a[i]/b[i])
		}
	}
	return median(v)
}

// Print writes the results as Markdown tables: every row of this build;
// Postgres round trips and waits by cause; with baseline rows, this build
// against the baseline; and Redis on against Redis off.
func Print(w io.Writer, results []Result) {
	printMain(w, results)
	printCauses(w, results)
	printBaseline(w, results)
	printRedisRatios(w, results)
}

func printMain(w io.Writer, results []Result) {
	fmt.Fprintln(w, "| row | msg/s | × baseline | CPU µs/msg: consumer | Postgres | RabbitMQ | Redis | total | round trips/msg: Postgres | Redis | peak RSS MiB | errors | breaker | doubled | missing |")
	fmt.Fprintln(w, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
	for _, r := range results {
		if r.Build != "" {
			continue
		}
		ratio := "–"
		if r.Row.Baseline != r.Row.Name && r.Ratio > 0 {
			ratio = fmt.Sprintf("%.2f× %s", r.Ratio, r.Row.Baseline)
		}
		rate := fmt.Sprintf("%.0f", r.Rate)
		if r.Row.Latency {
			rate = fmt.Sprintf("%.0f offered; p50 %.1f ms, p99 %.1f ms", r.Rate, r.P50, r.P99)
		}
		fmt.Fprintf(w, "| %s | %s | %s | %.0f | %.0f | %.0f | %.0f | %.0f | %.3f | %.3f | %.0f | %d | %d | %d | %d |\n",
			r.Row.Name, rate, ratio, r.CPU.Consumer, r.CPU.Postgres, r.CPU.RabbitMQ, r.CPU.Redis, r.CPU.Total(),
			r.PGTrips, r.RedisTrips, r.RSSMB, r.Errors, r.Breaker, r.Doubled, r.Missing)
	}
	for _, r := range results {
		if r.Build == "" && r.BytesPerKey > 0 {
			fmt.Fprintf(w, "\nRedis memory per done key (MEMORY USAGE, median of 200 keys, %s): %.0f bytes\n", r.Row.Name, r.BytesPerKey)
			break
		}
	}
}

// Chart writes an SVG bar chart of each row's throughput as a fraction of
// its raw baseline.
func Chart(w io.Writer, results []Result) {
	var rows []Result
	for _, r := range results {
		if r.Build == "" && strings.HasPrefix(r.Row.Baseline, "raw") && !r.Row.Latency {
			rows = append(rows, r)
		}
	}
	const barH, gap, left, width = 18, 6, 250, 520
	height := len(rows)*(barH+gap) + 50
	scale := 1.0 // the longest bar is width
	for _, r := range rows {
		scale = max(scale, r.Ratio)
	}
	fmt.Fprintf(w, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", left+width+140, height)
	fmt.Fprintf(w, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(w, `<text x="%d" y="16" font-weight="bold">throughput as a fraction of a raw consume+ack consumer (same stream, same run)</text>`+"\n", 10)
	for i, r := range rows {
		y := 30 + i*(barH+gap)
		color := "#9ecae1"
		switch {
		case r.Row.Mode == "raw":
			color = "#bdbdbd"
		case strings.HasPrefix(r.Row.Name, "batched"):
			color = "#3182bd"
		}
		ratio := r.Ratio
		if r.Row.Mode == "raw" {
			ratio = 1
		}
		fmt.Fprintf(w, `<text x="%d" y="%d" text-anchor="end">%s</text>`+"\n", left-8, y+13, html.EscapeString(r.Row.Name))
		fmt.Fprintf(w, `<rect x="%d" y="%d" width="%.0f" height="%d" fill="%s"/>`+"\n", left, y, ratio/scale*width, barH, color)
		fmt.Fprintf(w, `<text x="%.0f" y="%d">%.2f× (%.0f/s)</text>`+"\n", float64(left)+ratio/scale*width+4, y+13, ratio, r.Rate)
	}
	fmt.Fprintln(w, "</svg>")
}

// Label names the result's row, and its build if not this one.
func (r Result) Label() string { return label(r.Row.Name, r.Build) }

func label(name, build string) string {
	if build == "" {
		return name
	}
	return name + " (" + build + ")"
}

// printCauses writes the Postgres round trips and the time waited on them
// per message, by cause, of every result whose workers reported them.
func printCauses(w io.Writer, results []Result) {
	var rows []Result
	for _, r := range results {
		if r.Row.Mode == "idem" && len(r.PGByCause) > 0 {
			rows = append(rows, r)
		}
	}
	if len(rows) == 0 {
		return
	}
	fmt.Fprintln(w, "\nPostgres round trips and wait per message, by cause (trips/msg · µs waited/msg; the waits of concurrent transactions add up)")
	fmt.Fprintln(w)
	fmt.Fprint(w, "| row |")
	for _, c := range roundtrip.Causes {
		fmt.Fprintf(w, " %s |", c)
	}
	fmt.Fprintln(w, " total |")
	fmt.Fprintln(w, "|---|"+strings.Repeat("---:|", len(roundtrip.Causes)+1))
	for _, r := range rows {
		fmt.Fprintf(w, "| %s |", r.Label())
		var total CauseCost
		for _, c := range roundtrip.Causes {
			cc, ok := r.PGByCause[c]
			if !ok {
				fmt.Fprint(w, " – |")
				continue
			}
			total.Trips += cc.Trips
			total.WaitMicros += cc.WaitMicros
			fmt.Fprintf(w, " %s |", cc)
		}
		fmt.Fprintf(w, " %s |\n", total)
	}
}

func (c CauseCost) String() string { return fmt.Sprintf("%.3f · %.0f", c.Trips, c.WaitMicros) }

// printBaseline writes each idem row of this build beside the same row run
// with the baseline's workers.
func printBaseline(w io.Writer, results []Result) {
	if !slices.ContainsFunc(results, func(r Result) bool { return r.Build == BuildBaseline }) {
		return
	}
	fmt.Fprintln(w, "\nThis build against the baseline (--baseline-bin), each row's two builds run one after the other in every run, taking turns to go first")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| row | msg/s (this build) | msg/s (baseline) | this/baseline (median of the per-run ratios) | CPU µs/msg total: this vs baseline | Postgres trips/msg: this vs baseline | start-up ms: this vs baseline |")
	fmt.Fprintln(w, "|---|---:|---:|---:|---:|---:|---:|")
	for _, r := range results {
		base, ok := find(results, BuildBaseline, r.Row.Name)
		if r.Build != "" || !ok {
			continue
		}
		this, that := fmt.Sprintf("%.0f", r.Rate), fmt.Sprintf("%.0f", base.Rate)
		ratio := fmt.Sprintf("%.3f×", runRatio(r.RateRuns, base.RateRuns))
		if r.Row.Latency {
			// The rate is the offered one: the latencies are what differ.
			this, that = fmt.Sprintf("p50 %.1f ms, p99 %.1f ms", r.P50, r.P99), fmt.Sprintf("p50 %.1f ms, p99 %.1f ms", base.P50, base.P99)
			ratio = "–"
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %.0f vs %.0f | %.3f vs %.3f | %.0f vs %.0f |\n",
			r.Row.Name, this, that, ratio, r.CPU.Total(), base.CPU.Total(), r.PGTrips, base.PGTrips, r.StartupMs, base.StartupMs)
	}
}

// printRedisRatios writes, for each pair of rows that differ only in Redis
// on or off, the median of the per-run ratios of their throughputs, for
// this build and, if it ran, the baseline.
func printRedisRatios(w io.Writer, results []Result) {
	const on, off = ", Redis on, ", ", Redis off, "
	baseline := slices.ContainsFunc(results, func(r Result) bool { return r.Build == BuildBaseline })
	ratio := func(build, name string) string {
		a, okA := find(results, build, name)
		b, okB := find(results, build, strings.Replace(name, on, off, 1))
		if !okA || !okB || a.Row.Latency {
			return "–"
		}
		return fmt.Sprintf("%.3f×", runRatio(a.RateRuns, b.RateRuns))
	}
	header := false
	for _, r := range results {
		pipeline, rest, ok := strings.Cut(r.Row.Name, on)
		if r.Build != "" || !ok {
			continue
		}
		if _, paired := find(results, "", strings.Replace(r.Row.Name, on, off, 1)); !paired {
			continue
		}
		if !header {
			header = true
			fmt.Fprintln(w, "\nRedis on against Redis off: msg/s, median of the per-run ratios")
			fmt.Fprintln(w)
			if baseline {
				fmt.Fprintln(w, "| pipeline | duplicates | placement | on/off (this build) | on/off (baseline) |")
				fmt.Fprintln(w, "|---|---|---|---:|---:|")
			} else {
				fmt.Fprintln(w, "| pipeline | duplicates | placement | on/off |")
				fmt.Fprintln(w, "|---|---|---|---:|")
			}
		}
		dups, placement, remote := strings.Cut(rest, ", ")
		if !remote {
			placement = "same machine"
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s |", pipeline, dups, placement, ratio("", r.Row.Name))
		if baseline {
			fmt.Fprintf(w, " %s |", ratio(BuildBaseline, r.Row.Name))
		}
		fmt.Fprintln(w)
	}
}
