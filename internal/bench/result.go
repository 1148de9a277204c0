package bench

import (
	"fmt"
	"html"
	"io"
	"slices"
	"strings"
)

// Result is a row's medians over its runs.
type Result struct {
	Row  Row `json:"row"`
	Runs int `json:"runs"`
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
	res.P50 = medianOf(runs, func(r runResult) float64 { return r.P50 })
	res.P99 = medianOf(runs, func(r runResult) float64 { return r.P99 })
	res.BytesPerKey = medianOf(runs, func(r runResult) float64 { return r.BytesPerKey })
	return res
}

// ratios sets each result's Ratio to its baseline's, when that row ran.
func ratios(results []Result) {
	rate := map[string]float64{}
	for _, r := range results {
		rate[r.Row.Name] = r.Rate
	}
	for i, r := range results {
		if base := rate[r.Row.Baseline]; base > 0 {
			results[i].Ratio = r.Rate / base
		}
	}
}

// Find returns the result of the named row.
func Find(results []Result, name string) (Result, bool) {
	i := slices.IndexFunc(results, func(r Result) bool { return r.Row.Name == name })
	if i < 0 {
		return Result{}, false
	}
	return results[i], true
}

// Print writes the results as a Markdown table.
func Print(w io.Writer, results []Result) {
	fmt.Fprintln(w, "| row | msg/s | × baseline | CPU µs/msg: consumer | Postgres | RabbitMQ | Redis | total | round trips/msg: Postgres | Redis | peak RSS MiB | errors | breaker | doubled | missing |")
	fmt.Fprintln(w, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
	for _, r := range results {
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
		if r.BytesPerKey > 0 {
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
		if strings.HasPrefix(r.Row.Baseline, "raw") && !r.Row.Latency {
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
