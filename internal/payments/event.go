// Package payments is the reference handler: PAYMENT_COMPLETED events append
// to payments_ledger and add to account_balances. The handler is not
// idempotent by itself (payments_ledger has no unique key on event_id), so
// the guard alone stands between a redelivery and a double payment.
package payments

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
)

// TypePaymentCompleted is the one event type the reference handler applies.
const TypePaymentCompleted = "PAYMENT_COMPLETED"

// MaxUserIDLen bounds userId, in bytes.
const MaxUserIDLen = 128

// Dead-letter reasons for bad input.
const (
	ReasonInvalidJSON    = "invalid_json"
	ReasonInvalidUTF8    = "invalid_utf8"
	ReasonDuplicateKey   = "duplicate_key"
	ReasonUnknownField   = "unknown_field"
	ReasonNULCharacter   = "nul_character"
	ReasonInvalidEventID = "invalid_event_id"
	ReasonInvalidField   = "invalid_field"
	ReasonUnknownType    = "unknown_type"
)

// Reasons lists the handler's dead-letter reasons.
func Reasons() []string {
	return []string{ReasonInvalidJSON, ReasonInvalidUTF8, ReasonDuplicateKey, ReasonUnknownField, ReasonNULCharacter,
		ReasonInvalidEventID, ReasonInvalidField, ReasonUnknownType}
}

// Event is the message body:
//
//	{"eventId","userId","type","amount"[,"occurredAt"]}
//
// occurredAt, when the producer sends it, is an RFC 3339 time and is the
// event's time of record (see consumer.Config.Retention).
type Event struct {
	EventID    string    `json:"eventId"`
	UserID     string    `json:"userId"`
	Type       string    `json:"type"`
	Amount     int64     `json:"amount"`
	OccurredAt time.Time `json:"occurredAt,omitzero"`
}

// knownFields are the body's keys, spelled exactly so. Any other key is
// refused rather than ignored: a field the handler does not apply (a
// currency, say) may change what the payment means, and a payload hash that
// left it out would drop a changed re-send as a duplicate.
var knownFields = []string{"eventId", "userId", "type", "amount", "occurredAt"}

// Decode parses and validates a message body strictly, so that two different
// bodies are never read as the same event: the body must be one JSON object
// of valid UTF-8 with each known key exactly once, no other keys, no trailing
// data, and no NUL or invalid escapes in its strings. Every error is a
// consumer.Reject with one of the Reason constants; once the event ID was
// read, the Event returned with an error carries it (and nothing else), so
// that the dead letter names its event.
func Decode(body []byte) (Event, error) {
	if !utf8.Valid(body) {
		return Event{}, consumer.Reject(ReasonInvalidUTF8, fmt.Errorf("body is not valid UTF-8 (first bad byte at %d)", firstInvalidUTF8(body)))
	}
	fields, err := objectFields(body)
	if err != nil {
		return Event{}, err
	}
	id, err := stringField(fields, "eventId")
	if err != nil {
		return Event{}, err
	}
	if id == nil {
		return Event{}, consumer.Reject(ReasonInvalidEventID, errors.New("eventId is missing"))
	}
	if err := guard.ValidateID(*id); err != nil {
		return Event{}, consumer.Reject(ReasonInvalidEventID, err)
	}
	ev := Event{EventID: *id}

	user, err := stringField(fields, "userId")
	switch {
	case err != nil:
		return Event{EventID: ev.EventID}, err
	case user == nil || *user == "":
		return Event{EventID: ev.EventID}, fieldErr("userId", "missing or empty")
	case len(*user) > MaxUserIDLen:
		return Event{EventID: ev.EventID}, fieldErr("userId", "%d bytes, limit %d", len(*user), MaxUserIDLen)
	case strings.IndexFunc(*user, func(r rune) bool { return !unicode.IsPrint(r) }) >= 0:
		return Event{EventID: ev.EventID}, fieldErr("userId", "has an unprintable character")
	}
	ev.UserID = *user

	typ, err := stringField(fields, "type")
	switch {
	case err != nil:
		return Event{EventID: ev.EventID}, err
	case typ == nil:
		return Event{EventID: ev.EventID}, fieldErr("type", "missing")
	case *typ != TypePaymentCompleted:
		return Event{EventID: ev.EventID}, consumer.Reject(ReasonUnknownType, fmt.Errorf("type %q is not %s", *typ, TypePaymentCompleted))
	}
	ev.Type = *typ

	raw, ok := fields["amount"]
	if !ok || string(raw) == "null" {
		return Event{EventID: ev.EventID}, fieldErr("amount", "missing")
	}
	if ev.Amount, err = parseAmount(raw); err != nil {
		return Event{EventID: ev.EventID}, fieldErr("amount", "%v", err)
	}

	at, err := stringField(fields, "occurredAt")
	if err != nil {
		return Event{EventID: ev.EventID}, err
	}
	if at != nil {
		t, err := time.Parse(time.RFC3339Nano, *at)
		if err != nil {
			return Event{EventID: ev.EventID}, fieldErr("occurredAt", "want an RFC 3339 time such as 2026-11-30T12:00:00Z, got %q", *at)
		}
		ev.OccurredAt = t.UTC()
	}
	return ev, nil
}

// objectFields splits body, one JSON object, into its raw values by key,
// refusing duplicate, unknown and wrong-case keys and trailing data. The body
// is validated as JSON first, so the split only has to find where each key
// and value ends.
func objectFields(body []byte) (map[string]json.RawMessage, error) {
	if !json.Valid(body) {
		// Let the decoder say what is wrong, and where.
		var v any
		err := json.Unmarshal(body, &v)
		if err == nil {
			err = errors.New("invalid JSON")
		}
		return nil, consumer.Reject(ReasonInvalidJSON, err)
	}
	i := skipSpace(body, 0)
	if body[i] != '{' {
		return nil, consumer.Reject(ReasonInvalidJSON, errors.New("want a JSON object"))
	}
	fields := make(map[string]json.RawMessage, len(knownFields))
	for i = skipSpace(body, i+1); body[i] != '}'; i = skipSpace(body, i) {
		if body[i] == ',' {
			i = skipSpace(body, i+1)
		}
		end := valueEnd(body, i)
		key, err := jsonString(body[i:end])
		if err != nil {
			return nil, consumer.Reject(ReasonInvalidJSON, err)
		}
		if _, dup := fields[key]; dup {
			return nil, consumer.Reject(ReasonDuplicateKey, fmt.Errorf("key %q appears more than once", key))
		}
		if !slices.Contains(knownFields, key) {
			return nil, consumer.Reject(ReasonUnknownField, unknownFieldErr(key))
		}
		i = skipSpace(body, end)
		i = skipSpace(body, i+1) // the colon
		end = valueEnd(body, i)
		fields[key] = body[i:end]
		i = end
	}
	return fields, nil
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// valueEnd returns where the valid JSON value starting at b[i] ends.
func valueEnd(b []byte, i int) int {
	switch b[i] {
	case '"':
		for j := i + 1; ; j++ {
			switch b[j] {
			case '\\':
				j++
			case '"':
				return j + 1
			}
		}
	case '{', '[':
		depth := 0
		for j := i; ; j++ {
			switch b[j] {
			case '"':
				j = valueEnd(b, j) - 1
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return j + 1
				}
			}
		}
	}
	j := i
	for j < len(b) && !strings.ContainsRune(" \t\n\r,}]", rune(b[j])) {
		j++
	}
	return j
}

// jsonString decodes a valid JSON string literal; one without escapes is
// its bytes between the quotes.
func jsonString(lit []byte) (string, error) {
	if len(lit) < 2 || lit[0] != '"' {
		return "", fmt.Errorf("want a string, got %s", truncate(string(lit), 40))
	}
	if bytes.IndexByte(lit, '\\') < 0 {
		return string(lit[1 : len(lit)-1]), nil
	}
	var s string
	err := json.Unmarshal(lit, &s)
	return s, err
}

func unknownFieldErr(key string) error {
	for _, k := range knownFields {
		if strings.EqualFold(k, key) {
			return fmt.Errorf("unknown key %q (keys are case-sensitive: did you mean %q?)", key, k)
		}
	}
	return fmt.Errorf("unknown key %q (want only %s)", key, strings.Join(knownFields, ", "))
}

// stringField returns the string at key, nil if absent or null. A NUL or a
// U+FFFD (what encoding/json makes of an invalid \u escape) is refused, so
// that distinct inputs never decode to one string.
func stringField(fields map[string]json.RawMessage, key string) (*string, error) {
	raw, ok := fields[key]
	if !ok || string(raw) == "null" {
		return nil, nil
	}
	s, err := jsonString(raw)
	if err != nil {
		return nil, fieldErr(key, "want a string, got %s", truncate(string(raw), 40))
	}
	if i := strings.IndexByte(s, 0); i >= 0 {
		return nil, consumer.Reject(ReasonNULCharacter, fmt.Errorf("%s: NUL character at byte %d", key, i))
	}
	if strings.ContainsRune(s, utf8.RuneError) {
		return nil, consumer.Reject(ReasonInvalidUTF8, fmt.Errorf("%s: invalid \\u escape (lone surrogate) or U+FFFD", key))
	}
	return &s, nil
}

func firstInvalidUTF8(b []byte) int {
	for i := 0; i < len(b); {
		r, n := utf8.DecodeRune(b[i:])
		if r == utf8.RuneError && n <= 1 {
			return i
		}
		i += n
	}
	return -1
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// parseAmount accepts a JSON integer in [1, 2^53): minor units (cents), so
// no fractions and no exponents. The upper bound keeps the amount exact in
// every JSON reader.
func parseAmount(raw json.RawMessage) (int64, error) {
	s := string(raw)
	if strings.HasPrefix(s, `"`) {
		return 0, fmt.Errorf("want an integer, got a string %s", s)
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("want an integer in minor units, got %s", s)
	}
	if n <= 0 || n >= 1<<53 {
		return 0, fmt.Errorf("want 1 to 2^53-1, got %d", n)
	}
	return n, nil
}

func fieldErr(field, format string, args ...any) error {
	return consumer.Reject(ReasonInvalidField, fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...)))
}

// Hash fingerprints the event's content independently of JSON formatting and
// key order, so a re-send is a duplicate and a changed payload a conflict. It
// covers every field Decode accepts.
func (e Event) Hash() []byte {
	fields := []string{e.EventID, e.UserID, e.Type, strconv.FormatInt(e.Amount, 10)}
	if !e.OccurredAt.IsZero() { // absent, the hash is what it was before occurredAt existed
		fields = append(fields, e.OccurredAt.UTC().Format(time.RFC3339Nano))
	}
	return guard.HashFields(fields...)
}

// Marshal encodes the event as a message body.
func (e Event) Marshal() []byte {
	b, _ := json.Marshal(e) // cannot fail: strings and an int
	return b
}
