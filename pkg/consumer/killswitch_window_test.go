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

	// Good events and poison dilute the rate: 3 of 3+1+4 is below half.
	for i := range 3 {
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

	// Open: the class is handed back, whatever the event; others go on.
	require.Equal(t, killOpen, k.failed("g", "42P01", errMissing))
	require.Equal(t, killNone, k.failed("h", "handler_failed", "boom"))
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

	require.Equal(t, killNone, k.failed("c", "handler_failed", "boom"), "another failure: the probe goes on")
	require.True(t, k.probing())
	require.Equal(t, killOpen, k.failed("c", "42P01", errMissing), "the same failure: handed back")
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
	require.Equal(t, killNone, k.failed("g", "42P01", errMissing), "the window starts afresh")
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
