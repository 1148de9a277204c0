package guard

import (
	"crypto/sha256"
	"fmt"
	"time"
	"unicode"
	"unicode/utf8"
)

// MaxIDLen is the longest event ID a Guard accepts, in bytes.
const MaxIDLen = 256

// Event is what the guard needs to know about one event: its identity and a
// fingerprint of its payload.
type Event struct {
	// ID is the producer-assigned event ID (the idempotency key): 1 to
	// MaxIDLen bytes of printable UTF-8 (see ValidateID).
	ID string
	// Hash fingerprints the payload, so that the same ID arriving with a
	// different payload is reported as ErrPayloadConflict instead of being
	// dropped as a duplicate. Use HashFields or any stable digest.
	Hash []byte
	// ShardKey routes the event to its shard when the guard has several
	// (Config.Shards): the key of the data its effect writes (for a
	// payment, the user), so that the dedup row lives beside the effect.
	// It must not change between deliveries of one event. Ignored with one
	// store.
	ShardKey string
	// Time is when the producer says the event happened, if its payload
	// carries a time; zero otherwise. The consumer measures the event's age
	// from it (or else from the AMQP timestamp) to refuse replays older
	// than the dedup retention.
	Time time.Time
}

// ValidateID reports whether id can be used as an event ID: 1 to MaxIDLen
// bytes of valid UTF-8 whose characters are all printable (letters, marks,
// digits, punctuation, symbols and the ASCII space). Control characters, other
// spaces and U+FFFD (what a decoder puts in place of invalid bytes) are
// refused, so that two different byte strings can never be read as one ID and
// every ID prints unambiguously in logs. Redis keys and SQL parameters carry
// any such ID as it is.
func ValidateID(id string) error {
	if id == "" {
		return fmt.Errorf("%w: empty", ErrInvalidID)
	}
	if len(id) > MaxIDLen {
		return fmt.Errorf("%w: %d bytes, limit %d", ErrInvalidID, len(id), MaxIDLen)
	}
	for i, r := range id {
		switch {
		case r == utf8.RuneError:
			return fmt.Errorf("%w: invalid UTF-8 or U+FFFD at byte %d", ErrInvalidID, i)
		case !unicode.IsPrint(r):
			return fmt.Errorf("%w: unprintable character %U at byte %d", ErrInvalidID, r, i)
		}
	}
	return nil
}

// scopeByte reports whether c may appear in a scope.
func scopeByte(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	case c == '_', c == '-', c == '.':
		return true
	}
	return false
}

// HashFields returns a SHA-256 over fields, each length-prefixed so that no
// two different field lists share a digest ("ab","c" differs from "a","bc").
func HashFields(fields ...string) []byte {
	h := sha256.New()
	var n [8]byte
	for _, f := range fields {
		l := uint64(len(f))
		for i := range n {
			n[i] = byte(l >> (8 * i))
		}
		h.Write(n[:])
		h.Write([]byte(f))
	}
	return h.Sum(nil)
}

// Validate reports whether the guard can take e: a valid ID (see ValidateID)
// and a payload hash.
func (e Event) Validate() error {
	if err := ValidateID(e.ID); err != nil {
		return err
	}
	if len(e.Hash) == 0 {
		return fmt.Errorf("%w: %s has an empty payload hash", ErrInvalidEvent, e.ID)
	}
	return nil
}
