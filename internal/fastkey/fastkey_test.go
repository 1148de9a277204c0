package fastkey

import (
	"strings"
	"testing"
)

// hashTag is the part of a key Redis Cluster hashes to pick its slot: the
// text between the first '{' and the first '}' after it, if not empty;
// else the whole key.
func hashTag(key string) string {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			return key[i+1 : i+1+j]
		}
	}
	return key
}

// TestAnIDCannotPinItsKeyToASlot: whatever braces an event ID holds, its
// key has no hash tag, so Redis Cluster hashes the whole key; and two IDs
// never share a key, escaped-looking ones included.
func TestAnIDCannotPinItsKeyToASlot(t *testing.T) {
	ids := []string{
		"evt_1", "", "%", "%7B", "%7D", "%257B", "%25", "a%7Bb%7D", "a%7Bb}",
		"{", "}", "{}", "}{", "{x}", "a{b}", "a{b", "a}b", "{{x}}", "%{", "%7B{",
		":{x}", "x:{y}", "{x}:y", "evt_{victim}", "evt_%7Bvictim%7D",
	}
	keys := map[string]string{}
	for _, id := range ids {
		key := Key("idem", "svc", id)
		if tag := hashTag(key); tag != key {
			t.Errorf("ID %q: key %q has the hash tag %q", id, key, tag)
		}
		if other, ok := keys[key]; ok {
			t.Errorf("IDs %q and %q share the key %q", other, id, key)
		}
		keys[key] = id
	}
}

// TestAnIDWithoutBracesKeepsItsKey: the layout of the keys written before
// braces were escaped is unchanged, so their markers still count.
func TestAnIDWithoutBracesKeepsItsKey(t *testing.T) {
	for id, want := range map[string]string{
		"evt_1":    "idem:svc:evt_1",
		"a:b":      "idem:svc:a:b",
		"%7B":      "idem:svc:%7B",
		"":         "idem:svc:",
		"{x}":      "idem:svc%:%7Bx%7D",
		"50%{off}": "idem:svc%:50%25%7Boff%7D",
	} {
		if got := Key("idem", "svc", id); got != want {
			t.Errorf("Key(%q) = %q, want %q", id, got, want)
		}
	}
}
