// Package outbox sends a handler's messages to other systems exactly when
// its effect commits: Enqueue inserts them into the idem_outbox table through
// the guard's transaction, so they exist if and only if the event's effect
// and dedup row committed, and a relay publishes them afterwards: the one
// the front door runs (idem.Config.Outbox), a Relay a service runs itself
// (NewRelay), or the idem relay command.
//
// A relay publishes a message at least once: a relay that dies after the
// publish and before it marks the row sent publishes it again. Every
// re-publish carries the same message ID, derived from the event that sent
// it (ID), so a receiver that deduplicates by it (an idem consumer that takes
// the AMQP message ID as its event ID, an HTTP API that honours the
// Idempotency-Key header) applies it once.
package outbox

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/partition"
)

// Message is one outgoing message.
type Message struct {
	// EventID is the event that sends the message: one whose effect the
	// transaction applies. Required.
	EventID string
	// Index numbers the event's messages from 0. (scope, EventID, Index)
	// identifies the message (see ID): two messages of one event need two
	// indexes, and the same index is the same message on every attempt.
	Index int
	// To names the destination: one of the service's (idem.Config.Outbox),
	// or of the relay's that publishes the outbox. Required. To, Key, Type and ContentType are stored as text: valid
	// UTF-8 without NUL bytes.
	To string
	// Key orders messages: those of one key leave in commit order. A
	// queue destination also routes by it to its partition. Empty: the
	// message is ordered only with the other messages of its event. At
	// most 255 bytes: an exchange destination may route by it.
	Key string
	// Type is the message's type: the AMQP type property, or the
	// X-Idem-Type header of an HTTP request. Optional. At most 255 bytes,
	// with no control characters but tab.
	Type string
	// ContentType is the body's media type. Defaults to application/json.
	// At most 255 bytes, with no control characters but tab.
	ContentType string
	// Body is the payload: the AMQP body, or the HTTP request's body.
	Body []byte
}

// insert adds a batch of messages in one statement.
// event_at is the sending event's time (NULL: untimed), which the relay
// sends along as x-idem-source-time.
const insert = `INSERT INTO idem_outbox (scope, event_id, idx, destination, key, lane, type, content_type, body, event_at)
SELECT $1, * FROM unnest($2::text[], $3::int[], $4::text[], $5::text[], $6::smallint[], $7::text[], $8::text[], $9::bytea[], $10::timestamptz[])`

// Enqueue inserts msgs into the outbox through tx. Call it from a handler's
// Apply or ApplyBatch (or a guard's apply function) with the ctx and tx it
// was given: it refuses a ctx that is not an apply's, and a message whose
// EventID is not one of the events the transaction applies, because only
// that event's dedup row makes the message's ID unique. The same message
// enqueued twice in one transaction fails with a unique violation, which
// dead-letters the event. A message that could never be published (see
// Message's fields) is refused with an error that names the field, and so,
// in a service that declares its destinations (idem.Config.Outbox), is one
// To a destination it does not declare: the handler's error, retried and
// then dead-lettered as any other, and never a row no relay can send.
func Enqueue(ctx context.Context, tx pgx.Tx, msgs ...Message) error {
	if len(msgs) == 0 {
		return nil
	}
	a, ok := tier.ApplyFrom(ctx)
	if !ok {
		return errors.New("outbox: Enqueue outside a guard's apply: pass the ctx the handler was given")
	}
	known, _ := tier.DestinationsFrom(ctx) // nil: no check
	n := len(msgs)
	ids, to, keys, types, ctypes := make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	idx, lane := make([]int32, n), make([]int16, n)
	bodies := make([][]byte, n)
	at := make([]pgtype.Timestamptz, n)
	for i, m := range msgs {
		if err := m.validate(a, known); err != nil {
			return err
		}
		ids[i], idx[i], to[i], keys[i], types[i], bodies[i] = m.EventID, int32(m.Index), m.To, m.Key, m.Type, m.Body
		ctypes[i] = m.ContentType
		if ctypes[i] == "" {
			ctypes[i] = "application/json"
		}
		if bodies[i] == nil {
			bodies[i] = []byte{}
		}
		if t := a.TimeOf(m.EventID); !t.IsZero() {
			at[i] = pgtype.Timestamptz{Time: t, Valid: true}
		}
		key := m.Key
		if key == "" {
			key = m.EventID
		}
		// A key's messages share a lane, which one relay at a time
		// drains in order.
		lane[i] = int16(partition.Of(key, relay.Lanes))
	}
	if _, err := tx.Exec(ctx, insert, a.Scope, ids, idx, to, keys, lane, types, ctypes, bodies, at); err != nil {
		return fmt.Errorf("outbox: enqueue %d message(s): %w", n, err)
	}
	return nil
}

// maxShortstr is the longest AMQP short string, in bytes. The type and
// content-type properties and the routing key (an exchange destination
// without one routes by Key) are short strings.
const maxShortstr = 255

// validate refuses, inside the handler's transaction, a message the relay
// could never publish: left in the outbox it would fail on every attempt
// and go dead, or (ahead of its key's later messages) hold them back.
// known, if not nil, are the only destinations the service has.
func (m Message) validate(a *tier.Apply, known map[string]bool) error {
	fail := func(format string, args ...any) error {
		return fmt.Errorf("outbox: message %d of event %q: %s", m.Index, m.EventID, fmt.Sprintf(format, args...))
	}
	switch {
	case !a.Holds(m.EventID):
		return fail("the transaction does not apply that event")
	case m.To == "":
		return fail("To is required")
	case m.Index < 0 || m.Index > 1<<30:
		return fail("Index out of range")
	case known != nil && !known[m.To]:
		return fail("To %q is not one of the service's destinations (%s): declare it in idem.Config.Outbox", m.To, names(known))
	}
	for _, f := range []struct {
		name, v string
		max     int  // longest value in bytes; 0: no limit
		header  bool // sent as an HTTP header value
	}{
		{"To", m.To, 0, false},
		{"Key", m.Key, maxShortstr, false},
		{"Type", m.Type, maxShortstr, true},
		{"ContentType", m.ContentType, maxShortstr, true},
	} {
		if err := checkField(f.v, f.max, f.header); err != nil {
			return fail("%s %s", f.name, err)
		}
	}
	return nil
}

// checkField says why v cannot be stored (the outbox's text columns take
// only valid UTF-8 without NUL) or sent: longer than max bytes, or, for an
// HTTP header value, holding a control character other than tab, which
// net/http refuses to send.
func checkField(v string, max int, header bool) error {
	switch {
	case max > 0 && len(v) > max:
		return fmt.Errorf("is %d bytes long; the limit is %d bytes (an AMQP short string)", len(v), max)
	case !utf8.ValidString(v):
		return errors.New("is not valid UTF-8")
	case strings.IndexByte(v, 0) >= 0:
		return errors.New("holds a NUL byte")
	case header && strings.IndexFunc(v, func(r rune) bool { return (r < ' ' && r != '\t') || r == 0x7f }) >= 0:
		return errors.New("holds a control character (it is sent as an HTTP header value)")
	}
	return nil
}

// names lists a set's names, sorted, for an error.
func names(set map[string]bool) string {
	out := make([]string, 0, len(set))
	for n := range set {
		out = append(out, fmt.Sprintf("%q", n))
	}
	sort.Strings(out)
	return strings.Join(out, ", ")
}

// ID returns the message ID of the index-th message of event eventID in
// scope: 32 hex digits of a SHA-256 over the three, the same on every
// publish. The relay sends it as the AMQP message ID and as the HTTP
// Idempotency-Key header; it is a valid idem event ID.
func ID(scope, eventID string, index int) string { return relay.MessageID(scope, eventID, index) }
