package lab

import (
	"fmt"
	"io"
	"slices"
	"text/tabwriter"
)

// Print writes the comparison: one line per approach, the failure columns
// first, then the cost columns from the clean pass. Trips are round trips
// per message published; msg/s down is messages acked per second while
// Redis was down.
func Print(w io.Writer, rows []Row) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "pass:\tclean\tcrash\tcrash\tredis\tredis\tredis\tclean\tclean\tclean\t")
	fmt.Fprintln(tw, "approach\tdoubled\tdoubled\tlost\tdoubled\tlost\tmsg/s down\tPG trips\tRedis trips\tmsg/s\t")
	for _, r := range rows {
		c, k, d := r.Passes[PassClean], r.Passes[PassCrash], r.Passes[PassRedis]
		down := "-" // approaches without Redis do not notice
		if c.RedisTrips > 0 {
			down = fmt.Sprintf("%.0f", d.OutageRate)
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%s\t%.2f\t%.2f\t%.0f\t\n", r.Approach,
			c.Doubled, k.Doubled, k.Lost, d.Doubled, d.Lost, down, c.PGTrips, c.RedisTrips, c.Rate)
	}
	_ = tw.Flush()
	for _, r := range rows {
		for _, pass := range Passes {
			if n := r.Passes[pass].Stuck; n > 0 {
				fmt.Fprintf(w, "note: %s, %s pass: %d messages were still in the queue when the pass gave up (counted as lost if never applied)\n", r.Approach, pass, n)
			}
		}
	}
	printDownstream(w, rows)
	fmt.Fprintln(w)
	for _, r := range rows {
		fmt.Fprintf(w, "%-21s %s\n", r.Approach, r.Title)
	}
}

// printDownstream writes the downstream approaches' message counts: the
// payment's effect is exactly once in each (idem guards it); what differs
// is the message to the next service.
func printDownstream(w io.Writer, rows []Row) {
	var ds []Row
	for _, r := range rows {
		if slices.Contains(Downstream, r.Approach) {
			ds = append(ds, r)
		}
	}
	if len(ds) == 0 {
		return
	}
	fmt.Fprintln(w, "\nthe message to the next service (lost: a committed payment whose message never left; phantom: sent by an attempt that never committed; again: delivered more than once, same message ID):")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "pass:\tclean\tclean\tclean\tcrash\tcrash\tcrash\tredis\tredis\tredis\t")
	fmt.Fprintln(tw, "approach\tlost\tphantom\tagain\tlost\tphantom\tagain\tlost\tphantom\tagain\t")
	for _, r := range ds {
		fmt.Fprintf(tw, "%s", r.Approach)
		for _, pass := range Passes {
			p := r.Passes[pass]
			fmt.Fprintf(tw, "\t%d\t%d\t%d", p.DownLost, p.DownPhantom, p.DownTwice)
		}
		fmt.Fprintln(tw, "\t")
	}
	_ = tw.Flush()
}
