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

// Values a key holds: a lease is Pending and its holder's token, a done
// marker is Done and the committed payload hash in hex.
const (
	Pending = "pending:"
	Done    = "done:"
)

// Key returns the Redis key for an event. Redis keys are binary safe and
// neither prefix nor scope may contain ':', so any ID maps to one key.
func Key(prefix, scope, id string) string {
	return prefix + ":" + scope + ":" + id
}

// Marker is what the fast tier holds for one event, for operators.
type Marker struct {
	// State is FastPending for a lease (some consumer holds it, or held it
	// and crashed), FastDone for a done marker, FastSkipped for no key.
	State tier.FastState
	// Hash is the committed payload hash of a done marker.
	Hash []byte
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
	m := Marker{TTL: ttl.Val()}
	switch {
	case strings.HasPrefix(v, Done):
		m.State = tier.FastDone
		m.Hash, err = hex.DecodeString(v[len(Done):])
		if err != nil {
			return Marker{}, fmt.Errorf("inspect %q: bad done marker %q", key, v)
		}
	case strings.HasPrefix(v, Pending):
		m.State = tier.FastPending
	default:
		return Marker{}, fmt.Errorf("inspect %q: unexpected value %q", key, v)
	}
	return m, nil
}
