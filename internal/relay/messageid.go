package relay

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"
)

// MessageID is outbox.ID: the message ID of the index-th message of event
// eventID in scope, 32 hex digits of a SHA-256 over the three. It lives
// here, where it is sent, so that package outbox can wrap the relay.
func MessageID(scope, eventID string, index int) string {
	h := sha256.New()
	h.Write([]byte(scope))
	h.Write([]byte{0})
	h.Write([]byte(eventID))
	h.Write([]byte{0})
	h.Write(strconv.AppendInt(nil, int64(index), 10))
	return hex.EncodeToString(h.Sum(nil)[:16])
}
