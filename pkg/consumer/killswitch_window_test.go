package consumer

import (
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/guard"
)

// testSwitch returns a switch on a clock the test moves, with its trips.
func testSwitch(cfg KillSwitch) (*killSwitch, *time.Time, *tripCounter) {
	cfg.setDefaults()
	now := time.Unix(1_700_000_000, 0)
	tc := &tripCounter{}
	k := newKillSwitch(cfg, slog.New(slog.DiscardHandler), tc)
	k.now = func() time.Time { return now }
	return k, &now, tc
}

type tripCounter struct {
	nopObserver
	trips int
}

func (t *tripCounter) Count(name string, n int) {
	if name == wire.CounterKillSwitchTrips {
		t.trips += n
	}
}

const errMissing = `ERROR: relation "ledger" does not exist (SQLSTATE 42P01)`

// TestTheKillSwitchCountsDistinctEventsOfOneClassAtARate: the switch trips
// on the Threshold-th distinct event failing with one class, when they are
// at least Rate of the window's events; an event failing again is one
// event; other classes, good events and poison count only as settled; and
// the window forgets.
func TestTheKillSwitchCountsDistinctEventsOfOneClassAtARate(t *testing.T) {
	k, now, tc := testSwitch(KillSwitch{Threshold: 3, Rate: 0.5, Window: time.Minute})
	require.Equal(t, killNone, k.failed("a", "42P01", errMissing))
	require.Equal(t, killNone, k.failed("a", "42P01", errMissing), "the same event again is not a second event")
	require.Equal(t, killSuspect, k.failed("b", "42P01", errMissing), "a second event failing the same way is suspect")
	require.Equal(t, killNone, k.failed("x", "handler_failed", "boom"), "another class is counted apart")

	// Good events and poison dilute the rate: the 4 events that failed
	// (of any class) are below half of 4+5.
	for i := range 4 {
		k.settle(fmt.Sprint("good", i), guard.OutcomeProcessed)
	}
	k.settle("poison", guard.OutcomeDeadLettered)
	require.Equal(t, killNone, k.failed("c", "42P01", errMissing))
	why, _ := k.state()
	require.Empty(t, why)

	// A minute later all of it is forgotten: three fresh events trip it.
	*now = now.Add(time.Minute + time.Second)
	require.Equal(t, killNone, k.failed("d", "42P01", errMissing))
	require.Equal(t, killSuspect, k.failed("e", "42P01", errMissing))
	require.Equal(t, killOpen, k.failed("f", "42P01", errMissing))
	require.Equal(t, 1, tc.trips)
	why, class := k.state()
	require.Equal(t, "42P01", class)
	require.Contains(t, why, "3 distinct events failed with 42P01 within 1m0s (100% of the events settled)")
	require.Contains(t, why, `relation "ledger" does not exist`)
	require.Contains(t, why, "next probe in")

	// Open: every failure that counts is handed back, whatever its class.
	require.Equal(t, killOpen, k.failed("g", "42P01", errMissing))
	require.Equal(t, killOpen, k.failed("h", "handler_failed", "boom"))
	require.False(t, k.settle("i", guard.OutcomeProcessed), "not probing yet: nothing closes it")
}

// TestSuspicionStartsAtHalfTheThreshold: at the default threshold, two
// events failing the same way are not yet suspect (two bad messages of a
// kind are not a deploy); the third is.
func TestSuspicionStartsAtHalfTheThreshold(t *testing.T) {
	k, _, _ := testSwitch(KillSwitch{})
	require.Equal(t, killNone, k.failed("a", "handler_timeout", "timeout"))
	require.Equal(t, killNone, k.failed("b", "handler_timeout", "timeout"))
	require.Equal(t, killSuspect, k.failed("c", "handler_timeout", "timeout"))
	require.Equal(t, killSuspect, k.failed("d", "handler_timeout", "timeout"))
	require.Equal(t, killOpen, k.failed("e", "handler_timeout", "timeout"))
}

// TestAProbeClosesTheSwitchOnlyOnAProcessedEvent: a probe that fails the
// same way waits longer; a duplicate or a dead letter proves nothing; a
// processed event closes the switch and starts a fresh window.
func TestAProbeClosesTheSwitchOnlyOnAProcessedEvent(t *testing.T) {
	k, now, tc := testSwitch(KillSwitch{Threshold: 2, Probe: Backoff{Min: time.Second, Max: 4 * time.Second}})
	k.failed("a", "42P01", errMissing)
	require.Equal(t, killOpen, k.failed("b", "42P01", errMissing))
	require.False(t, k.probing())
	stop := make(chan struct{})
	*now = now.Add(time.Second) // the first probe is due
	require.True(t, k.awaitProbe(stop))
	require.True(t, k.probing())
	why, _ := k.state()
	require.Contains(t, why, "probing with one delivery")

	require.Equal(t, killOpen, k.failed("c", "42P01", errMissing), "a failure that counts: handed back")
	require.False(t, k.probing())
	k.mu.Lock()
	wait := k.open.probeAt.Sub(*now)
	k.mu.Unlock()
	require.GreaterOrEqual(t, wait, time.Second, "the second probe waits longer (2s, jittered down to 1s at least)")
	require.Equal(t, 1, tc.trips, "a failed probe is not a new trip")

	*now = now.Add(wait)
	require.True(t, k.awaitProbe(stop))
	require.False(t, k.settle("d", guard.OutcomeDuplicateRedis), "a duplicate never ran the handler")
	require.False(t, k.settle("e", guard.OutcomeDeadLettered))
	require.True(t, k.settle("f", guard.OutcomeProcessed))
	why, _ = k.state()
	require.Empty(t, why)

	// Armed for a window: another class starts afresh, the class it
	// tripped on trips it again at once, with a longer wait.
	require.Equal(t, killNone, k.failed("g", "handler_failed", "boom"), "another class starts afresh")
	require.Equal(t, killOpen, k.failed("h", "42P01", errMissing), "the class it tripped on, soon after: again at once")
	require.Equal(t, 2, tc.trips)
	k.mu.Lock()
	again := k.open.probeAt.Sub(*now)
	k.mu.Unlock()
	require.GreaterOrEqual(t, again, 2*time.Second, "the probes keep their longer wait (4s, jittered down to 2s at least)")

	// A window after it closed, the class is forgotten.
	*now = now.Add(again)
	require.True(t, k.awaitProbe(stop))
	require.True(t, k.settle("i", guard.OutcomeProcessed))
	*now = now.Add(time.Minute)
	require.Equal(t, killNone, k.failed("j", "42P01", errMissing), "a window later: counted afresh")
}

// TestAProbeThatMeetsNoFailureResumes: a probing switch whose probe met
// no failure that counts closes, armed, when the probe's time is up:
// whether the queue was empty or held only duplicates and poison, none of
// which runs the handler to the end. Before, a probe that settled a
// duplicate never closed the switch: a queue of redeliveries kept the
// consumer tripped until a new event came.
func TestAProbeThatMeetsNoFailureResumes(t *testing.T) {
	for name, met := range map[string][]guard.Outcome{
		"an empty queue":     nil,
		"only duplicates":    {guard.OutcomeDuplicateRedis, guard.OutcomeDuplicatePostgres},
		"poison":             {guard.OutcomeDeadLettered},
		"duplicates, poison": {guard.OutcomeDuplicatePostgres, guard.OutcomeDeadLettered},
	} {
		t.Run(name, func(t *testing.T) {
			k, now, _ := testSwitch(KillSwitch{Threshold: 1, Probe: Backoff{Min: time.Second, Max: 4 * time.Second}})
			require.Equal(t, killOpen, k.failed("a", "42P01", errMissing))
			require.False(t, k.probeIdle(), "not probing yet")
			*now = now.Add(time.Second)
			require.True(t, k.awaitProbe(make(chan struct{})))
			for i, o := range met {
				require.False(t, k.settle(fmt.Sprint("m", i), o), "%s proves nothing by itself", o)
			}
			require.True(t, k.probeIdle(), "nothing failed: resume")
			why, _ := k.state()
			require.Empty(t, why)
			require.Equal(t, killOpen, k.failed("c", "42P01", errMissing), "armed: the first failure of its class trips it again")
		})
	}

	// A probe that failed is not closed by its time running out.
	k, now, _ := testSwitch(KillSwitch{Threshold: 1, Probe: Backoff{Min: time.Second, Max: 4 * time.Second}})
	require.Equal(t, killOpen, k.failed("a", "42P01", errMissing))
	*now = now.Add(time.Second)
	require.True(t, k.awaitProbe(make(chan struct{})))
	require.Equal(t, killOpen, k.failed("b", "42P01", errMissing))
	require.False(t, k.probeIdle(), "the probe failed: it waits for the next")
	why, _ := k.state()
	require.NotEmpty(t, why)
}

// TestOneEventAtATimeTripsAtTheDefaults replays, on the switch's own
// clock, what handle (batch.go) does with a broken deploy when the
// consumer holds one failing event at a time (Prefetch 1, or KeyOrder's
// in-place retries on one worker), with every default of Config: each
// attempt calls failed; killNone at attempt >= DeliveryLimit dead-letters;
// killSuspect retries up to BrokerDeliveryLimit. The class's streak
// outlives the window while its failures keep coming, so the fifth
// distinct event trips it, after four dead letters (two at DeliveryLimit,
// two suspects at BrokerDeliveryLimit).
func TestOneEventAtATimeTripsAtTheDefaults(t *testing.T) {
	cfg := Config{URL: "amqp://", Queue: "q"}
	cfg.setDefaults()
	require.NoError(t, cfg.validate())
	now := time.Unix(1_700_000_000, 0)
	k := newKillSwitch(cfg.KillSwitch, slog.New(slog.DiscardHandler), nopObserver{})
	k.now = func() time.Time { return now }

	deadLettered, tripped := 0, false
	for e := 0; e < 100 && !tripped; e++ {
		id := fmt.Sprint("evt_", e)
		for attempt := 1; ; attempt++ {
			v := k.failed(id, "42P01", errMissing)
			if v == killOpen {
				tripped = true
				break
			}
			suspect := v == killSuspect
			if attempt >= cfg.DeliveryLimit && !(suspect && attempt < cfg.BrokerDeliveryLimit) {
				deadLettered++
				break
			}
			now = now.Add(cfg.RetryBackoff.Delay(attempt))
		}
		now = now.Add(10 * time.Millisecond) // the next delivery
	}
	require.True(t, tripped, "100 distinct events failed one after another; %d dead-lettered", deadLettered)
	require.LessOrEqual(t, deadLettered, 4)
}

// TestFailuresSplitOverClassesTrip: a forgotten migration that adds a
// table, a column and a function makes three event types fail with 42P01,
// 42703 and 42883. Each class is a third of the events, but every event
// fails: the rate counts the failures of every class, and the first class
// to reach Threshold trips the switch.
func TestFailuresSplitOverClassesTrip(t *testing.T) {
	k, _, tc := testSwitch(KillSwitch{})
	classes := []string{"42P01", "42703", "42883"}
	for i := range 60 {
		k.failed(fmt.Sprint("evt_", i), classes[i%3], "the migration was not applied")
	}
	require.Equal(t, 1, tc.trips)
	_, class := k.state()
	require.Equal(t, "42P01", class)
}

// TestAnOffSwitchNeverTrips: Off leaves every failure to the retry and
// dead-letter path.
func TestAnOffSwitchNeverTrips(t *testing.T) {
	k, _, tc := testSwitch(KillSwitch{Threshold: 1, Off: true})
	for i := range 10 {
		require.Equal(t, killNone, k.failed(fmt.Sprint(i), "42P01", errMissing))
	}
	require.Zero(t, tc.trips)
}

func TestKillSwitchValidationNamesTheField(t *testing.T) {
	for field, ks := range map[string]KillSwitch{
		"KillSwitch.Threshold": {Threshold: -1},
		"KillSwitch.Rate":      {Rate: 1.5},
		"KillSwitch.Window":    {Window: -time.Second},
		"KillSwitch.Probe":     {Probe: Backoff{Min: time.Second, Max: time.Millisecond}},
	} {
		cfg := Config{URL: "amqp://", Queue: "q", KillSwitch: ks}
		cfg.setDefaults()
		require.ErrorContains(t, cfg.validate(), field)
		cfg.KillSwitch.Off = true
		require.NoError(t, cfg.validate(), "an Off switch's settings are not checked")
	}
}

// TestALockWaitCountsOnceItOutlastsAnyEventsHold: waits on a lock another
// transaction holds count for the switch only once their spell has lasted a
// handler timeout, which no event of the consumer's own can hold a row for;
// an event that waited and is then processed ends the spell, and so does a
// handler timeout without a wait.
func TestALockWaitCountsOnceItOutlastsAnyEventsHold(t *testing.T) {
	const ht = 2 * time.Second
	k, now, _ := testSwitch(KillSwitch{})
	require.False(t, k.waitOutlasts("a", ht), "the first wait")
	*now = now.Add(ht / 2)
	require.False(t, k.waitOutlasts("b", ht), "within a handler timeout: a poison's hold, maybe")
	require.False(t, k.settle("a", guard.OutcomeProcessed))
	*now = now.Add(ht / 2)
	require.False(t, k.waitOutlasts("c", ht), "a waiter got its row: a new spell")
	*now = now.Add(ht / 2)
	require.False(t, k.waitOutlasts("d", ht))
	*now = now.Add(ht / 2)
	require.True(t, k.waitOutlasts("e", ht), "a handler timeout of waits and no waiter through: no event of ours holds it")
	require.True(t, k.waitOutlasts("f", ht))
	*now = now.Add(ht + time.Millisecond)
	require.False(t, k.waitOutlasts("g", ht), "a handler timeout without a wait: a new spell")
}

// TestATripOnPreparedStatementsNamesThePooler: claims that fail with a named
// statement missing (26000) or doubled (42P05) are a transaction-mode pooler
// idem's probe did not see, not the handler: the open switch says what to
// set.
func TestATripOnPreparedStatementsNamesThePooler(t *testing.T) {
	k := newKillSwitch(Config{}.WithDefaults().KillSwitch, slog.New(slog.DiscardHandler), nopObserver{})
	k.open = &trip{class: "42P05", sample: `store claim: ERROR: prepared statement "stmtcache_ab" already exists (SQLSTATE 42P05)`, since: time.Now()}
	why, _ := k.state()
	require.Contains(t, why, "set default_query_exec_mode=cache_describe")
	k.open = &trip{class: "42P01", sample: `relation "x" does not exist`, since: time.Now()}
	why, _ = k.state()
	require.NotContains(t, why, "default_query_exec_mode")
}
