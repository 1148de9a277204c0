package guard

import (
	"crypto/sha256"
	"fmt"
)

// MaxIDLen is the longest event ID a Guard accepts, in bytes.
const MaxIDLen = 128

// Event is what the guard needs to know about one event: its identity and a
// fingerprint of its payload.
type Event struct {
	// ID is the producer-assigned event ID (the idempotency key). 1 to
	// MaxIDLen bytes of [A-Za-z0-9_.:-].
	ID string
	// Hash fingerprints the payload, so that the same ID arriving with a
	// different payload is reported as ErrPayloadConflict instead of being
	// dropped as a duplicate. Use HashFields or any stable digest.
	Hash []byte
}

// ValidateID reports whether id can be used as an event ID. The charset keeps
// IDs printable in logs, Redis keys and SQL without escaping.
func ValidateID(id string) error {
	if id == "" {
		return fmt.Errorf("%w: empty", ErrInvalidID)
	}
	if len(id) > MaxIDLen {
		return fmt.Errorf("%w: %d bytes, limit %d", ErrInvalidID, len(id), MaxIDLen)
	}
	for i := 0; i < len(id); i++ {
		if !idByte(id[i]) {
			return fmt.Errorf("%w: byte %d (%q) is outside [A-Za-z0-9_.:-]", ErrInvalidID, i, id[i])
		}
	}
	return nil
}

func idByte(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	case c == '_', c == '-', c == '.', c == ':':
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

func (e Event) validate() error {
	if err := ValidateID(e.ID); err != nil {
		return err
	}
	if len(e.Hash) == 0 {
		return fmt.Errorf("%w: %s has an empty payload hash", ErrInvalidEvent, e.ID)
	}
	return nil
}
