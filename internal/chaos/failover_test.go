package chaos

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestTheFailoverVerdict: with a synchronous standby any acked payment or
// receipt lost fails the run, and so does any undone payment whose commit
// had been answered success, even if a later copy applied it again; with an asynchronous one the lost ones are
// reported, not failed, as long as the re-send applied exactly them; a
// missing payment no failover undid, or a re-send that applied or recorded
// other than what was missing, fails either.
func TestTheFailoverVerdict(t *testing.T) {
	cases := []struct {
		name     string
		f        FailoverReport
		hop      bool
		problems int
	}{
		{"sync, nothing lost", FailoverReport{Standby: "synchronous", Undone: 3}, true, 0},
		{"sync, a payment lost", FailoverReport{Standby: "synchronous", Lost: []string{"a"}, ReApplied: []string{"a"}, Receiptless: []string{"a"}, ReRecorded: []string{"a"}}, true, 1},
		{"sync, answered and undone, then applied again by a later copy", FailoverReport{Standby: "synchronous", Undone: 1, Answered: []string{"a"}}, true, 1},
		{"async, answered and undone", FailoverReport{Standby: "asynchronous", Undone: 1, Answered: []string{"a"}, Lost: []string{"a"}, ReApplied: []string{"a"}}, false, 0},
		{"sync, a receipt lost", FailoverReport{Standby: "synchronous", LostReceipts: []string{"a"}, Receiptless: []string{"a"}, ReRecorded: []string{"a"}}, true, 1},
		{"async, lost and re-applied", FailoverReport{Standby: "asynchronous", Lost: []string{"a", "b"}, ReApplied: []string{"a", "b"}, LostReceipts: []string{"c"}, Receiptless: []string{"a", "b", "c"}, ReRecorded: []string{"a", "b", "c"}}, true, 0},
		{"async, one not re-applied", FailoverReport{Standby: "asynchronous", Lost: []string{"a", "b"}, ReApplied: []string{"a"}}, false, 1},
		{"async, a receipt not recorded", FailoverReport{Standby: "asynchronous", Receiptless: []string{"c"}}, true, 1},
		{"async, missing and never undone", FailoverReport{Standby: "asynchronous", Unnamed: []string{"z"}}, false, 2},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			res := &Result{Failover: &c.f}
			if c.hop {
				res.Hop = &SecondHop{}
			}
			res.judge()
			require.Len(t, res.Problems, c.problems, res.Problems)
			require.Equal(t, c.problems == 0, res.OK)
		})
	}
}
