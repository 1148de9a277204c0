package chaos

import (
	"bytes"
	"fmt"
	"html"
	"html/template"
	"math"
	"os"
	"strings"
)

// kindColor gives each fault kind a colour in the report.
var kindColor = map[Kind]string{
	ConsumerKill: "#d62728", CrashPoint: "#9467bd", RedisKill: "#e6550d", RedisPause: "#fdae6b",
	RedisSlow: "#fdd0a2", RedisFlush: "#8c564b", RedisEvict: "#e377c2", PGTerminate: "#6baed6",
	PGRestart: "#2171b5", PGFailover: "#3f007d", AMQPClose: "#31a354", RabbitKill: "#17becf", HTTPFail: "#e377c2", HTTPSlow: "#bcbd22", HTTP401: "#8c564b", QueueDelete: "#6b6ecf", RelayCut: "#d62728",
	PGBlackhole: "#08306b", PGReset: "#4292c6", PGLatency: "#c6dbef", RedisBlackhole: "#7f2704",
	RedisReset: "#f16913", RedisLatency: "#fee6ce", AMQPBlackhole: "#00441b", AMQPReset: "#74c476", APIBlackhole: "#636363",
	HotRow: "#a50f15", Prune: "#54278f",
}

// WriteHTML writes a self-contained report: the timeline as an SVG chart
// (throughput, fault windows, breaker state, live consumers), the verdict
// and every fault. It needs no network and no script.
func (res *Result) WriteHTML(path string) error {
	var table bytes.Buffer
	res.Print(&table)
	data := struct {
		R     *Result
		Chart template.HTML
		Table string
		Kinds []Kind
		Color map[Kind]string
	}{res, template.HTML(res.svg()), table.String(), Kinds, kindColor}
	var b bytes.Buffer
	if err := reportTmpl.Execute(&b, data); err != nil {
		return err
	}
	return os.WriteFile(path, b.Bytes(), 0o644)
}

// svg draws the timeline. Geometry: a throughput plot, and under it three
// lanes: infrastructure faults, consumer faults, breaker and live consumers.
func (res *Result) svg() string {
	const (
		W, left, right = 1100.0, 110.0, 20.0
		plotTop, plotH = 20.0, 260.0
		laneH          = 22.0
	)
	tl := res.Timeline
	tmax := 1.0
	if len(tl) > 0 {
		tmax = math.Max(tl[len(tl)-1].T, 1)
	}
	for _, f := range res.Faults {
		tmax = math.Max(tmax, f.End)
	}
	x := func(t float64) float64 { return left + (W-left-right)*t/tmax }

	type pt struct{ t, v float64 }
	// Rates over a two-second window: consumers write their counts once a
	// second, so a shorter window would saw-tooth.
	rate := func(get func(Sample) int64) []pt {
		var out []pt
		j := 0
		for i := 1; i < len(tl); i++ {
			for j < i-1 && tl[i].T-tl[j+1].T >= 2 {
				j++
			}
			a, b := tl[j], tl[i]
			if get(a) < 0 || get(b) < 0 || b.T <= a.T {
				out = append(out, pt{b.T, math.NaN()})
				continue
			}
			out = append(out, pt{b.T, float64(get(b)-get(a)) / (b.T - a.T)})
		}
		return out
	}
	effects := rate(func(s Sample) int64 { return s.Effects })
	delivs := rate(func(s Sample) int64 { return s.Deliveries })
	vmax := 1.0
	for _, p := range append(append([]pt{}, effects...), delivs...) {
		if !math.IsNaN(p.v) {
			vmax = math.Max(vmax, p.v)
		}
	}
	vmax = niceCeil(vmax)
	y := func(v float64) float64 { return plotTop + plotH - plotH*v/vmax }

	lane1 := plotTop + plotH + 30
	lane2 := lane1 + laneH + 8
	lane3 := lane2 + laneH + 8
	H := lane3 + laneH + 30

	var s strings.Builder
	fmt.Fprintf(&s, `<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 %.0f %.0f" width="100%%" font-family="sans-serif" font-size="11">`, W, H)
	// Fault windows shade the plot too, so a dip lines up with its cause.
	for _, f := range res.Faults {
		if f.Kind.consumerFault() {
			continue
		}
		w := math.Max(x(f.End)-x(f.Start), 2)
		fmt.Fprintf(&s, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s" opacity="0.18"/>`,
			x(f.Start), plotTop, w, plotH, kindColor[f.Kind])
		fmt.Fprintf(&s, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%s</title></rect>`,
			x(f.Start), lane1, w, laneH, kindColor[f.Kind], html.EscapeString(faultTitle(f)))
	}
	// Axes and grid.
	for i := 0; i <= 4; i++ {
		v := vmax * float64(i) / 4
		fmt.Fprintf(&s, `<line x1="%.0f" x2="%.0f" y1="%.1f" y2="%.1f" stroke="#ddd"/><text x="%.0f" y="%.1f" text-anchor="end">%.0f</text>`,
			left, W-right, y(v), y(v), left-4, y(v)+4, v)
	}
	step := niceCeil(tmax / 10)
	for t := 0.0; t <= tmax; t += step {
		fmt.Fprintf(&s, `<line x1="%.1f" x2="%.1f" y1="%.0f" y2="%.0f" stroke="#eee"/><text x="%.1f" y="%.0f" text-anchor="middle">%.0fs</text>`,
			x(t), x(t), plotTop, lane3+laneH, x(t), H-12, t)
	}
	fmt.Fprintf(&s, `<text x="12" y="%.0f" transform="rotate(-90 12 %.0f)" text-anchor="middle">per second</text>`, plotTop+plotH/2, plotTop+plotH/2)
	line := func(pts []pt, color string) {
		var d strings.Builder
		pen := false
		for _, p := range pts {
			if math.IsNaN(p.v) {
				pen = false
				continue
			}
			cmd := "L"
			if !pen {
				cmd = "M"
			}
			fmt.Fprintf(&d, "%s%.1f %.1f ", cmd, x(p.t), y(p.v))
			pen = true
		}
		fmt.Fprintf(&s, `<path d="%s" fill="none" stroke="%s" stroke-width="1.6"/>`, d.String(), color)
	}
	line(delivs, "#999")
	line(effects, "#1f77b4")
	// Consumer faults: ticks on their lane and a faint line across the plot.
	for _, f := range res.Faults {
		if !f.Kind.consumerFault() {
			continue
		}
		fmt.Fprintf(&s, `<line x1="%.1f" x2="%.1f" y1="%.0f" y2="%.0f" stroke="%s" opacity="0.35"/>`,
			x(f.Start), x(f.Start), plotTop, plotTop+plotH, kindColor[f.Kind])
		fmt.Fprintf(&s, `<rect x="%.1f" y="%.1f" width="3" height="%.0f" fill="%s"><title>%s</title></rect>`,
			x(f.Start)-1.5, lane2, laneH, kindColor[f.Kind], html.EscapeString(faultTitle(f)))
	}
	for _, c := range res.Crashes {
		fmt.Fprintf(&s, `<circle cx="%.1f" cy="%.1f" r="4" fill="black"><title>%s died at %s (%.1fs)</title></circle>`,
			x(c.At), lane2+laneH/2, html.EscapeString(c.Consumer), html.EscapeString(c.Step), c.At)
	}
	// Breaker lane: darker the more consumers have the breaker open.
	for i := 1; i < len(tl); i++ {
		a, b := tl[i-1], tl[i]
		if b.BreakerOpen > 0 {
			fmt.Fprintf(&s, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.0f" fill="#d62728" opacity="%.2f"><title>%.1fs: breaker open on %d of %d consumers</title></rect>`,
				x(a.T), lane3, x(b.T)-x(a.T)+0.5, laneH, 0.25+0.75*float64(b.BreakerOpen)/float64(max(res.Consumers, 1)), b.T, b.BreakerOpen, res.Consumers)
		}
		if b.Alive < res.Consumers {
			fmt.Fprintf(&s, `<rect x="%.1f" y="%.1f" width="%.1f" height="4" fill="#333"><title>%.1fs: %d of %d consumers alive</title></rect>`,
				x(a.T), lane3+laneH+2, x(b.T)-x(a.T)+0.5, b.T, b.Alive, res.Consumers)
		}
	}
	for _, l := range []struct {
		y    float64
		name string
	}{{lane1, "infra faults"}, {lane2, "consumer faults"}, {lane3, "breaker open"}} {
		fmt.Fprintf(&s, `<text x="%.0f" y="%.1f" text-anchor="end">%s</text>`, left-4, l.y+laneH/2+4, l.name)
	}
	s.WriteString(`</svg>`)
	return s.String()
}

func faultTitle(f Fault) string {
	t := fmt.Sprintf("%s %.1fs–%.1fs: %s", f.Kind, f.Start, f.End, f.Detail)
	if f.Err != "" {
		t += " (FAILED: " + f.Err + ")"
	}
	return t
}

// niceCeil rounds v up to 1, 2 or 5 times a power of ten.
func niceCeil(v float64) float64 {
	if v <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}

var reportTmpl = template.Must(template.New("report").Parse(`<!doctype html>
<html><head><meta charset="utf-8"><title>idem-lab chaos {{.R.RunID}}: {{if .R.OK}}PASS{{else}}FAIL{{end}}</title>
<style>
body{font-family:sans-serif;max-width:1150px;margin:2em auto;color:#222}
pre{background:#f6f6f6;padding:1em;overflow:auto}
.pass{color:#2a7d2a}.fail{color:#c00}
table{border-collapse:collapse;font-size:13px}td,th{border-bottom:1px solid #ddd;padding:3px 8px;text-align:left}
.key span{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;vertical-align:middle}
</style></head><body>
<h1>idem-lab chaos run {{.R.RunID}} <span class="{{if .R.OK}}pass">PASS{{else}}fail">FAIL{{end}}</span></h1>
<p>Seed {{.R.Seed}}, {{.R.Consumers}} consumers{{if .R.Hop}} (and the second hop's receipts consumers, each running a relay){{end}}, stream of {{.R.Published}} messages ({{.R.Distinct}} distinct events)
published over {{.R.Duration}} at {{.R.Rate}} msg/s; {{len .R.Faults}} faults. Rerun with
<code>idem-lab chaos --seed {{.R.Seed}} --duration {{.R.Duration}} --rate {{.R.Rate}} --consumers {{.R.Consumers}}</code>.</p>
{{if not .R.OK}}<ul class="fail">{{range .R.Problems}}<li>{{.}}</li>{{end}}</ul>{{end}}
<h2>Timeline</h2>
<p class="key"><span style="background:#1f77b4"></span>effects applied per second (ledger rows; gaps while Postgres is down)
<span style="background:#999"></span>deliveries per second (every outcome)
<span style="background:#d62728"></span>breaker open (darker: more consumers); black bar: a consumer is down; dots: armed crash points that fired</p>
<p class="key">{{range .Kinds}}<span style="background:{{index $.Color .}}"></span>{{.}} {{end}}</p>
{{.Chart}}
<h2>Verdict</h2>
<pre>{{.Table}}</pre>
<h2>Faults</h2>
<table><tr><th>start</th><th>end</th><th>kind</th><th>what</th></tr>
{{range .R.Faults}}<tr><td>{{printf "%.1fs" .Start}}</td><td>{{printf "%.1fs" .End}}</td><td>{{.Kind}}</td><td>{{.Detail}}{{if .Err}} <b class="fail">FAILED: {{.Err}}</b>{{end}}</td></tr>
{{end}}</table>
</body></html>
`))
