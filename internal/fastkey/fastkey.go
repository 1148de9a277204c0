// Package fastkey is the fast tier's layout in Redis: one key per event,
// holding a lease or a done marker, and a reader of it for the tools.
package fastkey

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/internal/tier"
)

// Values a key holds: a lease is Pending, the history its holder last
// knew, ':' and the holder's token; a done marker is Done, the history the
// event committed in, ':' and the committed payload hash in hex. Versions
// before histories wrote Pending+token and Done+hash: such a value reads
// with no history (tier.History's zero), which confirms nothing.
const (
	Pending = "pending:"
	Done    = "done:"
)

// LeaseToken returns the token a lease of history h holds, for a holder's
// own token tok: Pending+LeaseToken is the lease's value, which a release
// compares whole.
func LeaseToken(h tier.History, tok string) string { return string(h) + ":" + tok }

// DoneValue returns the done marker of an event that committed with
// payload hash hash in history h.
func DoneValue(h tier.History, hash []byte) string {
	return Done + string(h) + ":" + hex.EncodeToString(hash)
}

// Parse reads a key's value: a lease (FastPending) or a done marker
// (FastDone, with its hash), each with the history it names.
func Parse(v string) (Marker, error) {
	var m Marker
	rest, ok := strings.CutPrefix(v, Done)
	if ok {
		m.State = tier.FastDone
		if h, hash, ok := strings.Cut(rest, ":"); ok {
			m.History, rest = tier.History(h), hash
		}
		var err error
		if m.Hash, err = hex.DecodeString(rest); err != nil || len(m.Hash) == 0 {
			return Marker{}, fmt.Errorf("bad done marker %q", v)
		}
		return m, nil
	}
	if rest, ok = strings.CutPrefix(v, Pending); ok {
		m.State = tier.FastPending
		if h, _, ok := strings.Cut(rest, ":"); ok {
			m.History = tier.History(h)
		}
		return m, nil
	}
	return Marker{}, fmt.Errorf("unexpected value %q", v)
}

// Key returns the Redis key for an event: prefix:scope:id, or, for an ID
// holding a brace, prefix:scope%:id with '%', '{' and '}' %-encoded. A
// producer then cannot put a hash tag ({…}) in a key and pin the events it
// names to one Redis Cluster slot; the key's tag, if any, is the prefix's.
//
// Any (scope, ID) maps to one key, and two map to two: neither prefix nor
// scope may contain ':' (nor scope '%'), so the part between the first two
// ':' tells the forms apart, and %-encoding '%' itself is reversible. An ID
// without braces keeps the key it always had.
func Key(prefix, scope, id string) string {
	if !strings.ContainsAny(id, "{}") {
		return prefix + ":" + scope + ":" + id
	}
	return prefix + ":" + scope + "%:" + braces.Replace(id)
}

// braces %-encodes what Key escapes in an ID.
var braces = strings.NewReplacer("%", "%25", "{", "%7B", "}", "%7D")

// Marker is what the fast tier holds for one event, for operators.
type Marker struct {
	// State is FastPending for a lease (some consumer holds it, or held it
	// and crashed), FastDone for a done marker, FastSkipped for no key.
	State tier.FastState
	// Hash is the committed payload hash of a done marker.
	Hash []byte
	// History is the history the value names: for a done marker, the one
	// its event committed in; for a lease, the one its holder last knew.
	History tier.History
	// TTL is how long the key has left to live.
	TTL time.Duration
}

// Inspect reads the key of one event, with a deadline of a second and
// no breaker: for tools, not for the event path.
func Inspect(ctx context.Context, rdb redis.UniversalClient, prefix, scope, id string) (Marker, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	key := Key(prefix, scope, id)
	var get *redis.StringCmd
	var ttl *redis.DurationCmd
	_, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		get = p.Get(ctx, key)
		ttl = p.PTTL(ctx, key)
		return nil
	})
	v, gerr := get.Result()
	switch {
	case errors.Is(gerr, redis.Nil):
		return Marker{State: tier.FastSkipped}, nil
	case err != nil:
		return Marker{}, fmt.Errorf("inspect %q: %w", key, err)
	}
	m, err := Parse(v)
	if err != nil {
		return Marker{}, fmt.Errorf("inspect %q: %w", key, err)
	}
	m.TTL = ttl.Val()
	return m, nil
}
