// Package console is idem console's web page: the fleet, its dead letters,
// its outbox and one event, for an operator answering "what is wrong, and
// how do I fix it" without five commands. It is server-rendered
// (html/template, embedded, no script) over a Backend that reads and acts
// through the same code as the CLI, so a replay from the page has the
// fences and refusals of idem dlq replay and idem outbox replay.
//
// Security: every page is read with no credentials (bind it where only
// operators reach it: loopback by default); every action is a POST that
// carries the page's CSRF token and an identity, either the login token's
// session cookie or a header a reverse proxy sets (Options.TrustedHeader);
// ReadOnly refuses every action; each action is logged with who, what and
// how many. Nothing the page shows holds a secret: the Backend masks the
// errors it returns, and every producer's text is escaped by the template.
package console

import (
	"context"
	"time"

	"github.com/idemhq/idem/internal/heartbeat"
)

// Backend reads and acts for the page.
type Backend interface {
	// Fleet is the running consumers and relays as they report
	// themselves, the stream's queues and the paused destinations.
	Fleet(ctx context.Context) (Fleet, error)
	// DeadLetters reads the dead-letter queue, grouped.
	DeadLetters(ctx context.Context) (DeadLetters, error)
	// ReplayLetters replays the dead letters sel picks (never a cut one).
	ReplayLetters(ctx context.Context, sel Selection) (Result, error)
	// PurgeLetters deletes the dead letters sel picks.
	PurgeLetters(ctx context.Context, sel Selection) (Result, error)
	// Outbox is the outbox per destination, and its dead rows.
	Outbox(ctx context.Context) (Outbox, error)
	// ReplayOutbox makes the dead rows of destination dest pending again,
	// or only the rows ids names ("shard:id"), when given.
	ReplayOutbox(ctx context.Context, dest string, ids []string) (Result, error)
	// Inspect shows one event as idem inspect does.
	Inspect(ctx context.Context, id string) (string, error)
}

// Fleet is the fleet page.
type Fleet struct {
	Now       time.Time // the database's clock, to judge the reports by
	Instances []heartbeat.Report
	Queues    []Queue
	Paused    []Paused
	Err       string // what could not be read (the rest is shown)
}

// Queue is one queue of the stream.
type Queue struct {
	Name      string
	Messages  int
	Consumers int
	Err       string
}

// Paused is a destination a relay paused.
type Paused struct {
	Destination, Relay, Class, LastError string
	Since, NextProbe, Written            time.Time
	Probes                               int
}

// DeadLetters is the dead-letter page.
type DeadLetters struct {
	Queue  string
	Total  int
	Groups []Group
	// Ungrouped counts the letters past MaxGroups groups (their reasons
	// and types are producers' words: unbounded).
	Ungrouped int
}

// MaxGroups is how many groups the page shows.
const MaxGroups = 100

// Group is the dead letters of one reason and event type.
type Group struct {
	Reason, Type   string
	Count          int
	Oldest, Newest time.Time
	Letters        []Letter // the first MaxShown
}

// MaxShown is how many letters of a group the page shows.
const MaxShown = 50

// Letter is one dead letter, inert: the template escapes every field.
type Letter struct {
	Key          string // picks it in a Selection
	EventID      string
	EventIDRead  bool
	MessageID    string
	Error        string
	Queue        string
	Attempts     int64
	Replays      int64
	At           time.Time
	ByBroker     bool
	Cut          bool  // carries only the first bytes of its body: never replayed
	BodyBytes    int64 // the whole body's length, when cut
	Body         string
	BodyShownCut bool // Body is cut for the page
	Headers      [][2]string
	PayloadHash  string
	Original     string // for a payload conflict: the dedup row it collided with
}

// Selection picks dead letters: a group (Reason and Type), or Keys; at
// most Max of them, and for a group none dead-lettered after Before, so
// that an action takes no more than the page showed: a letter that arrived
// since stays.
type Selection struct {
	Reason, Type string
	Keys         []string
	Max          int
	Before       time.Time
}

// Result is what an action did.
type Result struct {
	Done    int
	Refused int
	Note    string
}

// Outbox is the outbox page.
type Outbox struct {
	Destinations []Destination
	Dead         []Row
	Paused       []Paused
}

// Destination is one destination's rows.
type Destination struct {
	Name          string
	Pending, Dead int64
	OldestPending time.Duration
	Paused        bool
}

// Row is one outbox row.
type Row struct {
	ID, MessageID, Scope, EventID, Destination, State, LastError string
	Attempts                                                     int
	Created                                                      time.Time
}
