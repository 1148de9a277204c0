package chaos

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strings"

	"github.com/idemhq/idem/internal/fleet"
	"github.com/idemhq/idem/internal/telemetry"
	"github.com/idemhq/idem/internal/verify"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/guard"
)

// Result is what a run did and its verdict. It is written as chaos.json.
type Result struct {
	OK       bool     `json:"ok"`
	Problems []string `json:"problems"` // why OK is false

	Seed      uint64  `json:"seed"`
	RunID     string  `json:"runId"`
	Queue     string  `json:"queue"`
	Consumers int     `json:"consumers"`
	Duration  string  `json:"duration"`
	Rate      float64 `json:"rate"`
	Elapsed   string  `json:"elapsed"`

	Published int `json:"published"` // messages, re-sends included
	Distinct  int `json:"distinct"`

	// Outcomes sums every consumer's counts ("processed",
	// "dead_lettered/<reason>", "breaker/closed->open", ...).
	Outcomes        map[string]int64 `json:"outcomes"`
	Deliveries      int64            `json:"deliveries"`
	DeadLettered    map[string]int64 `json:"deadLettered"` // by reason
	Requeued        map[string]int64 `json:"requeued"`     // by reason
	Breaker         map[string]int64 `json:"breaker"`      // transitions
	Verify          verify.Report    `json:"verify"`
	LeftInQueue     int              `json:"leftInQueue"`
	DeadLetterQueue int              `json:"deadLetterQueue"`
	NotDrained      []string         `json:"notDrained"` // consumers that did not exit cleanly on SIGTERM

	// Hop is the second hop of a two-hop run; nil without one.
	Hop *SecondHop `json:"secondHop,omitempty"`
	// HopOutcomes sums the receipts consumers' counts, RelayOutcomes the
	// relays' of both fleets (outbox/sent, outbox/retry, outbox/dead).
	HopOutcomes   map[string]int64 `json:"hopOutcomes,omitempty"`
	RelayOutcomes map[string]int64 `json:"relayOutcomes,omitempty"`
	// Failover is a pg-failover run's: what its failovers undid, lost and
	// what the re-send applied; nil without the kind.
	Failover *FailoverReport `json:"failover,omitempty"`

	Planned  []Planned     `json:"planned"`
	Faults   []Fault       `json:"faults"`
	Crashes  []CrashRecord `json:"crashes"`
	Restarts int           `json:"restarts"`
	Timeline []Sample      `json:"timeline"`
}

// deliveries sums the outcome totals of one stats snapshot.
func deliveries(st map[string]int64) int64 {
	var n int64
	for _, o := range guard.Outcomes() {
		n += st[o.String()]
	}
	return n
}

// breakerState derives a consumer's breaker state from its transition
// counts: the breaker starts closed and moves closed→open→half-open→
// (open|closed), so the counts say where it is now.
func breakerState(st map[string]int64) string {
	open := st["breaker/closed->open"] + st["breaker/half-open->open"] - st["breaker/open->half-open"]
	half := st["breaker/open->half-open"] - st["breaker/half-open->open"] - st["breaker/half-open->closed"]
	switch {
	case open > 0:
		return "open"
	case half > 0:
		return "half-open"
	}
	return "closed"
}

// sumStats sums the processes' last counts.
func sumStats(procs []*fleet.Proc) map[string]int64 {
	out := map[string]int64{}
	for _, p := range procs {
		st, err := p.Stats()
		if err != nil {
			continue
		}
		for k, v := range st {
			if k != telemetry.GaugeUnacked {
				out[k] += v
			}
		}
	}
	return out
}

func (res *Result) collect(procs []*fleet.Proc) {
	res.Outcomes = sumStats(procs)
	res.Deliveries = deliveries(res.Outcomes)
	res.DeadLettered, res.Requeued, res.Breaker = map[string]int64{}, map[string]int64{}, map[string]int64{}
	for k, v := range res.Outcomes {
		if r, ok := strings.CutPrefix(k, guard.OutcomeDeadLettered.String()+"/"); ok {
			res.DeadLettered[r] = v
		}
		if r, ok := strings.CutPrefix(k, guard.OutcomeRetry.String()+"/"); ok {
			res.Requeued[r] = v
		}
		if t, ok := strings.CutPrefix(k, "breaker/"); ok {
			res.Breaker[t] = v
		}
	}
}

// FaultCounts counts the injected faults by kind (failed ones excluded).
func (res *Result) FaultCounts() map[Kind]int {
	n := map[Kind]int{}
	for _, f := range res.Faults {
		if f.Err == "" {
			n[f.Kind]++
		}
	}
	return n
}

func (res *Result) judge() {
	v := res.Verify
	add := func(cond bool, format string, args ...any) {
		if cond {
			res.Problems = append(res.Problems, fmt.Sprintf(format, args...))
		}
	}
	add(v.Doubled > 0, "%d events applied more than once", v.Doubled)
	add(v.Missing > 0, "%d events never applied", v.Missing)
	add(v.WrongAmount > 0, "%d events applied with a wrong amount", v.WrongAmount)
	add(v.Strays > 0, "%d ledger rows for events never published", v.Strays)
	add(v.BalanceMismatch > 0, "%d balances differ from the sum of their payments", v.BalanceMismatch)
	add(v.Misrouted > 0, "%d ledger rows or balances on a shard other than their user's", v.Misrouted)
	add(res.LeftInQueue > 0, "%d messages stuck in the queue", res.LeftInQueue)
	add(res.DeadLetterQueue > 0, "%d messages in the dead-letter queue", res.DeadLetterQueue)
	// Nothing in a chaos run is a broken deploy: an outage, a wait on a row
	// or on prune, a crash are never the events' own failure.
	trips := res.Outcomes["count/"+wire.CounterKillSwitchTrips] + res.HopOutcomes["count/"+wire.CounterKillSwitchTrips]
	add(trips > 0, "the kill switch tripped %d times (no fault of a chaos run is a broken deploy)", trips)
	add(len(res.NotDrained) > 0, "consumers did not drain on SIGTERM: %s", strings.Join(res.NotDrained, "; "))
	res.judgeHop(add)
	res.judgeFailover(add)
	for _, f := range res.Faults {
		add(f.Err != "", "fault %s at %.1fs could not be injected: %s", f.Kind, f.Start, f.Err)
	}
	res.OK = len(res.Problems) == 0
}

// Print writes the verdict table.
func (res *Result) Print(w io.Writer) {
	var t table
	row, head := t.row, t.head
	fmt.Fprintf(w, "chaos run %s (seed %d): %d consumers, %s at %.0f msg/s, %s in all\n\n",
		res.RunID, res.Seed, res.Consumers, res.Duration, res.Rate, res.Elapsed)
	head("STREAM")
	row("messages published", res.Published)
	row("distinct events", res.Distinct)
	row("deliveries counted", res.Deliveries)
	row("applied (processed)", res.Outcomes[guard.OutcomeProcessed.String()])
	row("duplicates dropped by Redis", res.Outcomes[guard.OutcomeDuplicateRedis.String()])
	row("duplicates caught by Postgres", res.Outcomes[guard.OutcomeDuplicatePostgres.String()])
	row("duplicates of an event in the same batch", res.Outcomes[guard.OutcomeDuplicateBatch.String()])
	row("payload conflicts", res.Outcomes[guard.OutcomePayloadConflict.String()])
	row("requeued (attempt failed, store held too long, shutdown)", res.Outcomes[guard.OutcomeRetry.String()])
	for _, k := range slices.Sorted(maps.Keys(res.Requeued)) {
		row("  "+k, res.Requeued[k])
	}
	row("retried in place (Postgres unreachable)", res.Outcomes["count/"+wire.CounterStoreRetry])
	row("reconnects to RabbitMQ", res.Outcomes["count/"+wire.CounterReconnect])
	row("dead-lettered", res.Outcomes[guard.OutcomeDeadLettered.String()])
	for _, k := range slices.Sorted(maps.Keys(res.DeadLettered)) {
		row("  "+k, res.DeadLettered[k])
	}
	head("FAULTS")
	counts := res.FaultCounts()
	steps := map[string]int{}
	for _, c := range res.Crashes {
		steps[c.Step]++
	}
	for _, k := range Kinds {
		if n, ok := counts[k]; ok {
			row(string(k), n)
		}
		if k != CrashPoint {
			continue
		}
		for _, s := range slices.Sorted(maps.Keys(steps)) {
			row("  died at "+s, steps[s])
		}
	}
	row("consumer restarts", res.Restarts)
	head("REDIS BREAKER")
	if len(res.Breaker) == 0 {
		row("transitions", 0)
	}
	for _, k := range slices.Sorted(maps.Keys(res.Breaker)) {
		row(k, res.Breaker[k])
	}
	head("VERDICT")
	row("applied exactly once", res.Verify.ExactlyOnce)
	row("doubled effects", res.Verify.Doubled)
	row("missing effects", res.Verify.Missing)
	row("wrong amounts", res.Verify.WrongAmount)
	row("balance mismatches", res.Verify.BalanceMismatch)
	if res.Verify.Shards > 1 {
		row("rows on the wrong shard", res.Verify.Misrouted)
	}
	row("left in queue", res.LeftInQueue)
	row("in dead-letter queue", res.DeadLetterQueue)
	row("kill switch trips", res.Outcomes["count/"+wire.CounterKillSwitchTrips]+res.HopOutcomes["count/"+wire.CounterKillSwitchTrips])
	res.printHop(&t)
	res.printFailover(&t)
	t.print(w)
	fmt.Fprintln(w)
	if res.OK {
		if f := res.Failover; f != nil && len(f.Lost)+len(f.LostReceipts) > 0 {
			fmt.Fprintf(w, "(the failovers to an asynchronous standby lost %s and %s the fleet had acked (named in chaos.json); the re-send applied each once)\n",
				count(len(f.Lost), "payment"), count(len(f.LostReceipts), "receipt"))
		}
		if res.Hop != nil {
			fmt.Fprintln(w, "PASS: every event applied exactly once, every receipt recorded once and acted on once by the API, nothing lost, nothing stuck")
			return
		}
		fmt.Fprintln(w, "PASS: every event applied exactly once, nothing lost, nothing stuck")
		return
	}
	fmt.Fprintln(w, "FAIL:")
	for _, p := range res.Problems {
		fmt.Fprintln(w, "  - "+p)
	}
}

// WriteJSON writes the result, timeline included, to path.
func (res *Result) WriteJSON(path string) error {
	b, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}

// table prints headed sections of name–value rows, names left and values
// right-aligned across every section.
type table struct{ rows [][2]string }

func (t *table) head(s string) { t.rows = append(t.rows, [2]string{s, ""}) }
func (t *table) row(name string, v any) {
	t.rows = append(t.rows, [2]string{"  " + name, fmt.Sprint(v)})
}
func (t *table) print(w io.Writer) {
	nw, vw := 0, 0
	for _, r := range t.rows {
		nw, vw = max(nw, len([]rune(r[0]))), max(vw, len(r[1]))
	}
	for _, r := range t.rows {
		if r[1] == "" {
			fmt.Fprintln(w, r[0])
			continue
		}
		fmt.Fprintf(w, "%-*s  %*s\n", nw, r[0], vw, r[1])
	}
}
