package redistier

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"

	"github.com/idemhq/idem/internal/fastkey"
	"github.com/idemhq/idem/internal/redisfault"
	"github.com/idemhq/idem/internal/tier"
	"github.com/idemhq/idem/pkg/guard"
)

// Defaults for Config.
const (
	defaultPrefix  = "idem"
	defaultLease   = 30 * time.Second
	defaultDoneTTL = 24 * time.Hour
	defaultTimeout = 50 * time.Millisecond
)

const pendingPrefix = fastkey.Pending

// Config configures a Filter.
type Config struct {
	// Prefix starts every key: "<prefix>:<scope>:<event id>" (braces in
	// the ID escaped: docs/guard.md). Defaults to
	// "idem". It may not contain ':'.
	Prefix string
	// Lease is how long a pending lease lives, so that a crashed
	// consumer's lease frees itself. Longer than the slowest handler run.
	// Defaults to 30s.
	Lease time.Duration
	// DoneTTL is how long a done marker lives: the window in which a
	// duplicate is dropped without touching Postgres. Defaults to 24h.
	DoneTTL time.Duration
	// Timeout bounds every Redis call. Defaults to 50ms.
	Timeout time.Duration
	// Breaker configures the circuit breaker around Redis.
	Breaker BreakerConfig
}

// WithDefaults returns c with every unset field, the breaker's included, at
// its default: the values a Filter runs with.
func (c Config) WithDefaults() Config {
	c.setDefaults()
	return c
}

func (c *Config) setDefaults() {
	if c.Prefix == "" {
		c.Prefix = defaultPrefix
	}
	if c.Lease == 0 {
		c.Lease = defaultLease
	}
	if c.DoneTTL == 0 {
		c.DoneTTL = defaultDoneTTL
	}
	if c.Timeout == 0 {
		c.Timeout = defaultTimeout
	}
	c.Breaker.setDefaults()
}

func (c *Config) validate() error {
	if strings.Contains(c.Prefix, ":") {
		return fmt.Errorf("redistier: Prefix %q may not contain ':'", c.Prefix)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"Lease", c.Lease}, {"DoneTTL", c.DoneTTL}, {"Timeout", c.Timeout}} {
		if d.v < time.Millisecond {
			return fmt.Errorf("redistier: %s must be at least 1ms, got %s", d.name, d.v)
		}
	}
	return c.Breaker.validate()
}

// Filter is the Redis fast tier. It is safe for concurrent use.
type Filter struct {
	rdb     redis.UniversalClient
	cfg     Config
	breaker *gobreaker.CircuitBreaker[struct{}]
	failing *streak
}

var _ guard.FastPath = (*Filter)(nil)

// New returns a Filter over rdb: a *redis.Client (one server, or a Sentinel
// set through redis.NewFailoverClient), a *redis.ClusterClient or a
// *redis.Ring. Its options must have ContextTimeoutEnabled set, or a dead or
// stopped node would hold each call for the client's ReadTimeout instead of
// Config.Timeout.
func New(rdb redis.UniversalClient, cfg Config) (*Filter, error) {
	if rdb == nil {
		return nil, errors.New("redistier: nil redis client")
	}
	if err := checkDeadlines(rdb); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	f := &Filter{rdb: rdb, cfg: cfg, failing: &streak{}}
	f.breaker = newBreaker(cfg.Breaker, f.failing)
	return f, nil
}

// BreakerState reports the circuit breaker's state: "closed", "half-open" or "open".
func (f *Filter) BreakerState() string { return f.breaker.State().String() }

// Claim runs SET key pending:<history>:<token> NX PX <lease> GET for every
// event in one pipeline, and returns what each key held: a done marker comes
// back with the history it names, for the guard to confirm. history is the
// one the caller last knew; a lease's history only tells an operator when
// it was taken. The leases of one call share a token: they have one holder.
func (f *Filter) Claim(ctx context.Context, scope string, history tier.History, events []guard.Event) []tier.FastResult {
	out := make([]tier.FastResult, len(events))
	token := fastkey.LeaseToken(history, newToken())
	value := pendingPrefix + token
	lease := strconv.FormatInt(f.cfg.Lease.Milliseconds(), 10)
	answered := false
	err := f.call(ctx, func(ctx context.Context) error {
		cmds := make([]*redis.Cmd, len(events))
		// Each command carries its own error; Pipelined's is the first
		// of them, which for a new event is redis.Nil.
		_, _ = f.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, ev := range events {
				cmds[i] = p.Do(ctx, "SET", fastkey.Key(f.cfg.Prefix, scope, ev.ID), value, "PX", lease, "NX", "GET")
			}
			return nil
		})
		var failed error
		for i, cmd := range cmds {
			out[i] = parseClaim(cmd, token)
			if failed == nil {
				failed = out[i].Err
			}
		}
		answered = true
		// A node that failed part of the pipeline (a dead cluster master)
		// counts against the breaker, while the other keys keep their answers.
		return failed
	})
	if err != nil && !answered {
		for i := range out {
			out[i] = tier.FastResult{State: tier.FastSkipped, Err: err}
		}
	}
	return out
}

func parseClaim(cmd *redis.Cmd, token string) tier.FastResult {
	old, err := cmd.Text()
	switch {
	case errors.Is(err, redis.Nil):
		return tier.FastResult{State: tier.FastAcquired, Token: token}
	case err != nil:
		return tier.FastResult{State: tier.FastSkipped, Err: err}
	}
	m, err := fastkey.Parse(old)
	if err != nil {
		return tier.FastResult{State: tier.FastSkipped, Err: err}
	}
	if m.State == tier.FastPending {
		return tier.FastResult{State: tier.FastPending}
	}
	return tier.FastResult{State: tier.FastDone, Hash: m.Hash, History: m.History}
}

// MarkDone runs SET key done:<history>:<hash> PX <doneTTL> for every event in
// one pipeline, over whatever the key held (a lease, or a marker of another
// history). Call it only after the events committed in Postgres, with the
// history the store reported in the transaction that committed them (or
// that found their rows).
func (f *Filter) MarkDone(ctx context.Context, scope string, history tier.History, events []guard.Event) error {
	err := f.call(ctx, func(ctx context.Context) error {
		_, err := f.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, ev := range events {
				p.Set(ctx, fastkey.Key(f.cfg.Prefix, scope, ev.ID), fastkey.DoneValue(history, ev.Hash), f.cfg.DoneTTL)
			}
			return nil
		})
		return err
	})
	if err != nil {
		return fmt.Errorf("redistier: mark done: %w", err)
	}
	return nil
}

// releaseScript deletes one key only if it still holds the caller's token.
// It touches one key, so that on a Redis Cluster each call runs on the node
// that owns that key's slot: a script over several keys would fail with
// CROSSSLOT as soon as two leases hash to different slots.
const releaseScript = `if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0`

// Release compare-and-deletes the leases, one script call per key in one
// pipeline (which a cluster client splits by node): a key is removed only
// while it still holds the caller's pending token.
func (f *Filter) Release(ctx context.Context, scope string, leases []tier.Lease) error {
	err := f.call(ctx, func(ctx context.Context) error {
		_, err := f.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, l := range leases {
				p.Eval(ctx, releaseScript, []string{fastkey.Key(f.cfg.Prefix, scope, l.ID)}, pendingPrefix+l.Token)
			}
			return nil
		})
		return err
	})
	if err != nil {
		return fmt.Errorf("redistier: release: %w", err)
	}
	return nil
}

// checkDeadlines refuses a client that would ignore the context's deadline.
func checkDeadlines(rdb redis.UniversalClient) error {
	var on bool
	switch c := rdb.(type) {
	case *redis.Client:
		on = c.Options().ContextTimeoutEnabled
	case *redis.ClusterClient:
		on = c.Options().ContextTimeoutEnabled
	case *redis.Ring:
		on = c.Options().ContextTimeoutEnabled
	default:
		return fmt.Errorf("redistier: unsupported redis client %T; use *redis.Client, *redis.ClusterClient or *redis.Ring", rdb)
	}
	if !on {
		return fmt.Errorf("redistier: %T needs ContextTimeoutEnabled = true in its options so that per-call deadlines apply", rdb)
	}
	return nil
}

// tokens makes lease tokens unique across processes and calls: a random
// prefix drawn once per process, and a counter.
var tokens = struct {
	prefix string
	n      atomic.Uint64
}{prefix: randomHex(12)}

func newToken() string {
	return tokens.prefix + strconv.FormatUint(tokens.n.Add(1), 36)
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // crypto/rand.Read never fails on Linux
	return hex.EncodeToString(b)
}

// call runs fn through the breaker with the per-call deadline. An open
// breaker returns at once with gobreaker.ErrOpenState.
func (f *Filter) call(ctx context.Context, fn func(ctx context.Context) error) error {
	_, err := f.breaker.Execute(func() (struct{}, error) {
		cctx, cancel := context.WithTimeout(ctx, f.cfg.Timeout)
		defer cancel()
		err := fn(cctx)
		if err != nil && callerGone(ctx) {
			return struct{}{}, fmt.Errorf("%w: %w", redisfault.ErrCallerGone, err)
		}
		f.failing.record(err)
		return struct{}{}, err
	})
	return err
}
