// Package fastkey is the fast tier's layout in Redis: one key per event,
// holding a lease or a done marker, and a reader of it for the tools.
package fastkey

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
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

// scanBudget bounds how many keys AnyOf reads, on each node.
const scanBudget = 50_000

// AnyOf reports whether the fast tier holds any key of scope under prefix
// (a marker or a lease of any event), so that a tool can tell a key
// absent for an event from a prefix or scope that finds nothing of idem's
// at all. known is false when the scan stopped at its budget (scanBudget
// keys a node) without finding one: then it cannot say.
func AnyOf(ctx context.Context, rdb redis.UniversalClient, prefix, scope string) (found, known bool, err error) {
	// Both key shapes of Key: prefix:scope:id and prefix:scope%:id.
	pattern := globEscape(prefix+":"+scope) + "[:%]*"
	scan := func(ctx context.Context, c redis.Cmdable) (bool, bool, error) {
		var cursor uint64
		for read := 0; read < scanBudget; {
			keys, next, err := c.Scan(ctx, cursor, pattern, 1000).Result()
			if err != nil {
				return false, false, err
			}
			if len(keys) > 0 {
				return true, true, nil
			}
			read += 1000
			if cursor = next; cursor == 0 {
				return false, true, nil
			}
		}
		return false, false, nil
	}
	cc, ok := rdb.(*redis.ClusterClient)
	if !ok {
		return scan(ctx, rdb)
	}
	var mu sync.Mutex
	known = true
	err = cc.ForEachMaster(ctx, func(ctx context.Context, node *redis.Client) error {
		f, k, err := scan(ctx, node)
		mu.Lock()
		defer mu.Unlock()
		found, known = found || f, known && k
		return err
	})
	if found {
		return true, true, nil
	}
	return false, known && err == nil, err
}

// globEscape escapes what a SCAN MATCH pattern reads as a wildcard.
func globEscape(s string) string {
	var b strings.Builder
	for _, r := range s {
		if strings.ContainsRune(`*?[]\^`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}
