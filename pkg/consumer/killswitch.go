package consumer

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/idemhq/idem/internal/pgerr"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/guard"
)

// Defaults for KillSwitch. Five distinct events and half of what settled in
// a minute: a burst of bad messages among good ones stays under the rate,
// and a broken deploy crosses both in well under a second at any real
// traffic, long before an event spends its DeliveryLimit.
const (
	defaultKillThreshold = 5
	defaultKillRate      = 0.5
	defaultKillWindow    = time.Minute
)

// defaultProbeBackoff spaces the probes of a tripped switch: soon enough to
// resume within seconds of a quick fix, rarely enough that a long outage
// costs the queue's head one delivery every five minutes.
var defaultProbeBackoff = Backoff{Min: 10 * time.Second, Max: 5 * time.Minute}

// KillSwitch stops a consumer whose handler fails for distinct events in the
// same way: a broken deploy (a migration forgotten, a permission revoked, a
// handler bug), not bad messages. Without it such a consumer retries each
// event DeliveryLimit times and dead-letters the whole stream while it looks
// healthy. (A network error from the handler, a downstream gone, reads as
// the store unreachable: it is held in place, as a Postgres outage is, and
// never reaches the switch.)
//
// Only an event's own failure that may be the deploy's counts: a handler
// or store error retried with backoff (handler_failed, store_failed,
// commit_failed, handler_timeout), by class: its SQLSTATE when PostgreSQL
// gave one (42P01 for a missing table), else its reason. A wait does not:
// BEGIN or the claim cancelled by lock_timeout (55P03), a guard statement
// that ran out of time, a handler that ran out of time while its store did
// not answer (each held as the store unreachable, as a Postgres outage
// is); a handler's statement cancelled by lock_timeout on a row another
// transaction holds counts only once such waits have lasted a handler
// timeout (waitOutlasts), and is never dead-lettered for its attempts. A
// message the consumer rejects for what it is (undecodable, a payload
// conflict, a data or integrity error, outside the horizon, Reject) is
// poison and never counts; it counts only among
// the events settled. The switch trips when at least Threshold
// distinct events failed with one class in a streak (each failure of the
// class within Window of the one before it, however long it lasts: with
// one event in flight at a time, each takes its retries before the next),
// and the events that failed within Window (of any class that counts) are
// at least Rate of the events settled or failed in that window.
//
// Tripped, the consumer stops taking deliveries and hands back every one it
// holds untried, and no event is dead-lettered for the failures that
// tripped it. RabbitMQ counts each hand-back as a delivery (x-delivery-count,
// which the consumer reads as its attempts too): a trip that lasts through
// about BrokerDeliveryLimit probes lets the broker dead-letter the messages
// handed back most often (with x-death, without idem's reason header;
// idem dlq replays them). Stats.Tripped says why (so /readyz is not ready).
// After Probe's backoff a session takes one delivery per queue:
// processed, and the consumer resumes; a failure that counts, and it is
// handed back and the next probe waits longer; poison is handled as ever
// (dead-lettered), a duplicate acked, and the probe goes on. A probe that
// meets no failure that counts within Probe.Min and a handler timeout
// resumes too: the queue is empty, or held only duplicates and poison, and
// a consumer is not kept unready for a cause it met nothing to test. After a resume the switch stays armed for Window: the
// first failure of the class it tripped on trips it again at once, and the
// probes keep their longer wait, so that a deploy broken for one kind of
// event gives each of those events one attempt per probe, not
// DeliveryLimit.
//
// While half of Threshold (two at least) distinct events failed with one
// class at that rate, an event of the class that exhausts DeliveryLimit is
// not dead-lettered yet: it goes back to the queue until the switch decides,
// or until BrokerDeliveryLimit deliveries, whichever comes first. So a
// broken deploy under light traffic dead-letters a handful at most, and
// three bad messages of one kind alone in a quiet queue (at the default
// Threshold) reach the dead-letter queue after BrokerDeliveryLimit
// deliveries instead of DeliveryLimit.
type KillSwitch struct {
	// Threshold is how many distinct events must fail with one error class
	// within Window for the switch to trip. Defaults to 5.
	Threshold int
	// Rate is the least share, above 0 and at most 1, of the events settled
	// or failed within Window that those events must be: one bad event
	// among good ones never trips the switch. Defaults to 0.5.
	Rate float64
	// Window is how far back failures and settled events count. Defaults
	// to 1m.
	Window time.Duration
	// Probe spaces a tripped consumer's probes: the first after Probe.Min,
	// each failed one doubling the wait up to Probe.Max. Defaults to 10s to
	// 5m.
	Probe Backoff
	// Off disables the switch: every failure takes the retry and
	// dead-letter path alone. Defaults to false.
	Off bool
}

func (k *KillSwitch) setDefaults() {
	if k.Threshold == 0 {
		k.Threshold = defaultKillThreshold
	}
	if k.Rate == 0 {
		k.Rate = defaultKillRate
	}
	if k.Window == 0 {
		k.Window = defaultKillWindow
	}
	if k.Probe == (Backoff{}) {
		k.Probe = defaultProbeBackoff
	}
}

func (k *KillSwitch) validate() error {
	switch {
	case k.Off:
		return nil
	case k.Threshold < 1:
		return fmt.Errorf("consumer: KillSwitch.Threshold must be at least 1, got %d", k.Threshold)
	case !(k.Rate > 0 && k.Rate <= 1):
		return fmt.Errorf("consumer: KillSwitch.Rate must be above 0 and at most 1, got %g", k.Rate)
	case k.Window <= 0:
		return fmt.Errorf("consumer: KillSwitch.Window must be positive, got %s", k.Window)
	}
	return nil
}

// failureClass names what a failed attempt has in common with the failures
// of other events: its SQLSTATE when PostgreSQL gave one, else its reason. A
// timeout is a timeout whatever the server said of the cancelled statement.
func failureClass(reason string, err error) string {
	code := pgerr.SQLState(err)
	if code == pgerr.LockNotAvailable || code != "" && reason != wire.ReasonHandlerTimeout {
		return code
	}
	return reason
}

// waited reports a failed attempt that waited on another transaction: a
// handler's statement cancelled by lock_timeout on a row that transaction
// holds (a poison event hung holding it, a report, a migration). See
// killSwitch.waitOutlasts.
func waited(err error) bool {
	return pgerr.SQLState(err) == pgerr.LockNotAvailable
}

// killVerdict is what the switch makes of a failed attempt.
type killVerdict int

const (
	// killNone: the failure is the event's, as far as the switch knows.
	killNone killVerdict = iota
	// killSuspect: half the threshold's events (two at least) fail the
	// same way; do not dead-letter this one for its attempts while the
	// switch decides. Half, not two: two bad messages of a kind, or two
	// slow ones while the others wait on a lock, are not a deploy.
	killSuspect
	// killOpen: the switch is open on this class; hand the delivery back,
	// unspent, and stop.
	killOpen
)

// killSwitch is a consumer's KillSwitch at work. A Consumer has one, shared
// by its sessions: a trip outlives the session that tripped it.
type killSwitch struct {
	cfg KillSwitch
	log *slog.Logger
	obs Observer
	now func() time.Time

	mu sync.Mutex
	// failures are the window's failures, oldest first; ids counts them by
	// event, for the rate.
	failures []failure
	ids      map[string]int
	// streaks are the distinct events failed with each class, while its
	// failures keep coming within Window of each other; at most Threshold
	// are kept.
	streaks map[string]*streak
	// settled counts the window's other settled events, in buckets of a
	// sixtieth of the window, oldest first; nSettled is their sum.
	settled  []tally
	nSettled int
	open     *trip // nil while closed
	trips    int   // trips and failed probes since the switch first opened
	// armed is the class the switch last tripped on, until armedUntil: its
	// next failure trips the switch again at once.
	armed      string
	armedUntil time.Time
	// wait is the current spell of lock waits (waited): when its first
	// and its last wait failed, and the events that waited in it (at most
	// maxWaiters).
	wait struct {
		since, last time.Time
		waiters     map[string]bool
	}
}

// maxWaiters bounds the events a wait spell remembers.
const maxWaiters = 1024

type streak struct {
	ids  map[string]bool
	last time.Time
}

type failure struct {
	at        time.Time
	class, id string
}

type tally struct {
	at time.Time
	n  int
}

// trip is an open switch.
type trip struct {
	class, sample string
	events        int     // distinct events failed with class when it tripped
	share         float64 // their share of the window's events
	since         time.Time
	probeAt       time.Time // when the next probe starts
	probing       bool
}

func newKillSwitch(cfg KillSwitch, log *slog.Logger, obs Observer) *killSwitch {
	return &killSwitch{cfg: cfg, log: log, obs: obs, now: time.Now, ids: map[string]int{}, streaks: map[string]*streak{}}
}

// failed records that the event id failed with class, its error reading
// sample, and says what to do with it.
func (k *killSwitch) failed(id, class, sample string) killVerdict {
	if k.cfg.Off {
		return killNone
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	now := k.now()
	if o := k.open; o != nil {
		// Open, every failure that counts is handed back: the deploy is
		// broken, whatever class this one fails with.
		if o.probing {
			k.trips++
			delay := k.cfg.Probe.Delay(k.trips)
			o.probing, o.probeAt, o.sample = false, now.Add(delay), sample
			k.log.Warn("kill switch: the probe failed; every delivery handed back, probing again later",
				"class", class, "err", o.sample, "probe_in", delay.Round(time.Millisecond), "probes_failed", k.trips-1)
		}
		return killOpen
	}
	k.disarm(now)
	if k.armed != "" && class == k.armed {
		k.trips++
		k.trip(now, class, sample, 1, 1, true)
		return killOpen
	}
	k.prune(now)
	k.failures = append(k.failures, failure{at: now, class: class, id: id})
	k.ids[id]++
	st := k.streaks[class]
	if st == nil {
		st = &streak{ids: map[string]bool{}}
		k.streaks[class] = st
	}
	st.last = now
	if len(st.ids) < k.cfg.Threshold {
		st.ids[id] = true
	}
	n := len(st.ids)
	share := float64(len(k.ids)) / float64(k.nSettled+len(k.ids))
	switch {
	case share < k.cfg.Rate:
		return killNone
	case n >= k.cfg.Threshold:
		k.trips = 1
		k.trip(now, class, sample, n, share, false)
		return killOpen
	case n >= max(2, (k.cfg.Threshold+1)/2):
		return killSuspect
	}
	return killNone
}

// waitOutlasts records that the event id failed waiting on a lock another
// transaction holds (waited), and reports whether the spell of such waits
// has lasted handlerTimeout: only then does the wait count for the switch.
// A lock one of the consumer's own events holds (a poison event hung on a
// hot row) is let go within a handler timeout, when that event's attempt
// ends, and an event that waited behind it is then processed, which ends
// the spell. A lock held longer is no event's: a deploy's migration, a
// handler waiting on its own transaction through another connection. The
// switch must see it, or the stream is dead-lettered behind it.
func (k *killSwitch) waitOutlasts(id string, handlerTimeout time.Duration) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	now := k.now()
	w := &k.wait
	if w.waiters == nil || now.Sub(w.last) > handlerTimeout {
		w.since, w.waiters = now, map[string]bool{}
	}
	w.last = now
	if len(w.waiters) < maxWaiters {
		w.waiters[id] = true
	}
	return now.Sub(w.since) >= handlerTimeout
}

// disarm forgets the class the switch last tripped on once its Window
// has passed, and with it the probes' longer wait. Callers hold k.mu.
func (k *killSwitch) disarm(now time.Time) {
	if k.armed != "" && !now.Before(k.armedUntil) {
		k.armed, k.trips = "", 0
	}
}

// trip opens the switch on class; again: it closed within Window of its
// last trip, on the same class. Callers hold k.mu and set k.trips.
func (k *killSwitch) trip(now time.Time, class, sample string, n int, share float64, again bool) {
	delay := k.cfg.Probe.Delay(k.trips)
	k.open = &trip{class: class, sample: sample, events: n, share: share, since: now, probeAt: now.Add(delay)}
	k.armed = ""
	k.reset()
	k.obs.Count(wire.CounterKillSwitchTrips, 1)
	if again {
		k.log.Error("kill switch tripped again: the class it tripped on failed again soon after it closed; consuming nothing and handing back every delivery unspent until a probe succeeds",
			"class", class, "err", sample, "probe_in", delay.Round(time.Millisecond), "probes_failed", k.trips-1)
		return
	}
	k.log.Error("kill switch tripped: distinct events all fail the same way, which is the deploy's fault, not theirs; consuming nothing and handing back every delivery unspent until a probe succeeds",
		"class", class, "events", n, "share", fmt.Sprintf("%.0f%%", 100*share), "window", k.cfg.Window, "err", sample,
		"probe_in", delay.Round(time.Millisecond))
}

// close closes the open switch, armed on its class. Callers hold k.mu.
func (k *killSwitch) close(now time.Time, why string) {
	t := k.open
	k.log.Info("kill switch closed: "+why+"; consuming again", "class", t.class,
		"open_for", now.Sub(t.since).Round(time.Millisecond), "probes_failed", k.trips-1)
	k.open = nil
	k.armed, k.armedUntil = t.class, now.Add(k.cfg.Window)
	k.reset()
}

// settle records a delivery settled with o (not a retry), and reports
// whether that closed the switch: an event processed during a probe.
func (k *killSwitch) settle(id string, o guard.Outcome) bool {
	if k.cfg.Off {
		return false
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	now := k.now()
	if t := k.open; t != nil {
		// Only an event the handler applied proves the deploy works: a
		// duplicate never ran it, poison failed for what it is. Either
		// is settled and the probe goes on with the next delivery.
		if !t.probing || o != guard.OutcomeProcessed {
			return false
		}
		k.close(now, "a probe was processed")
		return true
	}
	if o == guard.OutcomeProcessed && k.wait.waiters[id] {
		k.wait.waiters = nil // an event that waited got its row: the spell is over
	}
	k.disarm(now)
	k.prune(now)
	if k.ids[id] > 0 {
		return false // counted among the failures
	}
	if n := len(k.settled); n > 0 && now.Sub(k.settled[n-1].at) < k.cfg.Window/60 {
		k.settled[n-1].n++
	} else {
		k.settled = append(k.settled, tally{at: now, n: 1})
	}
	k.nSettled++
	return false
}

// prune forgets what fell out of the window, and the streaks that ended.
// Callers hold k.mu.
func (k *killSwitch) prune(now time.Time) {
	cut := now.Add(-k.cfg.Window)
	i := 0
	for ; i < len(k.failures) && !k.failures[i].at.After(cut); i++ {
		id := k.failures[i].id
		if k.ids[id]--; k.ids[id] == 0 {
			delete(k.ids, id)
		}
	}
	k.failures = k.failures[i:]
	for class, st := range k.streaks {
		if !st.last.After(cut) {
			delete(k.streaks, class)
		}
	}
	j := 0
	for ; j < len(k.settled) && !k.settled[j].at.After(cut); j++ {
		k.nSettled -= k.settled[j].n
	}
	k.settled = k.settled[j:]
}

// reset forgets the window. Callers hold k.mu.
func (k *killSwitch) reset() {
	k.failures, k.settled, k.nSettled = nil, nil, 0
	clear(k.streaks)
	clear(k.ids)
}

// awaitProbe returns at once while the switch is closed or probing;
// while it is open, it waits for the next probe and starts it. It reports
// false if stop ended first.
func (k *killSwitch) awaitProbe(stop <-chan struct{}) bool {
	k.mu.Lock()
	t := k.open
	if t == nil || t.probing {
		k.mu.Unlock()
		return true
	}
	wait := t.probeAt.Sub(k.now())
	k.mu.Unlock()
	if wait > 0 {
		timer := time.NewTimer(wait)
		defer timer.Stop()
		select {
		case <-timer.C:
		case <-stop:
			return false
		}
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.open != nil {
		k.open.probing = true
		k.log.Info("kill switch: probing with one delivery per queue", "class", k.open.class)
	}
	return true
}

// probeIdle closes the switch, armed, if it is still probing: its probe
// met no failure that counts, only an empty queue, duplicates or poison,
// none of which can tell a working deploy from a broken one. Armed, the
// first failure of the class it tripped on trips it again at once. It
// reports whether it closed it.
func (k *killSwitch) probeIdle() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	t := k.open
	if t == nil || !t.probing {
		return false
	}
	k.close(k.now(), "the probe met no failure (an empty queue, duplicates or poison)")
	return true
}

// probing reports whether the switch is open and probing.
func (k *killSwitch) probing() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.open != nil && k.open.probing
}

// state says why the switch is open, and on what class; empty while it is
// closed.
func (k *killSwitch) state() (why, class string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	t := k.open
	if t == nil {
		return "", ""
	}
	next := "probing with one delivery"
	if !t.probing {
		next = fmt.Sprintf("next probe in %s", max(0, t.probeAt.Sub(k.now())).Round(100*time.Millisecond))
	}
	return fmt.Sprintf("kill switch open for %s: %d distinct events failed with %s within %s (%.0f%% of the events settled): %s%s; %s",
		k.now().Sub(t.since).Round(time.Second), t.events, t.class, k.cfg.Window, 100*t.share, t.sample, hint(t), next), t.class
}

// hint says what a trip's class usually means where it is not the
// handler's: a named statement missing or doubled is a transaction-mode
// pooler that idem's probe did not see.
func hint(t *trip) string {
	if (t.class == "26000" || t.class == "42P05") && strings.Contains(t.sample, "prepared statement") {
		return " (a transaction-mode connection pooler shares server sessions between clients: set default_query_exec_mode=cache_describe in the database URL; in pgx, ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe)"
	}
	return ""
}

// cause is the error of the deliveries handed back because the switch is
// open.
func (k *killSwitch) cause() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.open == nil {
		return errKillSwitch
	}
	return fmt.Errorf("%w on %s: %s", errKillSwitch, k.open.class, k.open.sample)
}

// errKillSwitch is why a delivery goes back to the queue while the switch is
// open.
var errKillSwitch = errors.New("kill switch open")

// Errors that end a session for the kill switch: it tripped (the next
// session waits for the probe), or a probe was processed (the next session
// takes the full prefetch again).
var (
	errTripped = errors.New("kill switch tripped: every delivery handed back")
	errResumed = errors.New("kill switch closed: consuming again")
)
