package redistier

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"
)

// minRedisVersion is the oldest Redis the fast tier works with: Claim's
// SET … NX PX … GET arrived in 7.0. On an older server every Claim fails,
// the breaker stays open, and the tier is silently off.
const minRedisVersion = "7.0"

// ErrRedisTooOld is returned by CheckServer for a Redis older than minRedisVersion.
var ErrRedisTooOld = errors.New("redis is too old for the fast tier")

// ErrNoSuchDatabase is returned by CheckServer when the server refuses the
// database number the client selects (redis://host:6379/N, beyond the
// server's databases setting): every call would fail as if Redis were down.
var ErrNoSuchDatabase = errors.New("redis has no database of the number the client selects")

// CheckServer asks the server for its version and returns ErrRedisTooOld
// (wrapped with the version) if it is older than minRedisVersion, or
// ErrNoSuchDatabase if it refuses the client's database number. Call it at
// start: both are settings to fix, not outages to wait out. A server that
// does not answer is a plain error; the breaker handles that at run time.
func CheckServer(ctx context.Context, rdb redis.UniversalClient) error {
	info, err := rdb.Info(ctx, "server").Result()
	if err != nil {
		// go-redis sends SELECT as it opens a connection, and returns its
		// refusal as the error of the command that opened it.
		var reply redis.Error
		if errors.As(err, &reply) && strings.HasPrefix(reply.Error(), "ERR DB index is out of range") {
			db := "?"
			if c, ok := rdb.(interface{ Options() *redis.Options }); ok {
				db = strconv.Itoa(c.Options().DB)
			}
			return fmt.Errorf("%w: it answers SELECT %s with %q (the number at the end of the Redis URL)", ErrNoSuchDatabase, db, err.Error())
		}
		return fmt.Errorf("redis INFO server: %w", err)
	}
	return checkVersion(info)
}

func checkVersion(info string) error {
	for line := range strings.Lines(info) {
		v, ok := strings.CutPrefix(strings.TrimSpace(line), "redis_version:")
		if !ok {
			continue
		}
		major, rest, _ := strings.Cut(v, ".")
		minor, _, _ := strings.Cut(rest, ".")
		maj, err1 := strconv.Atoi(major)
		_, err2 := strconv.Atoi(minor)
		if err1 != nil || err2 != nil {
			return fmt.Errorf("redis INFO server: unreadable redis_version %q", v)
		}
		if maj < 7 {
			return fmt.Errorf("%w: %s lacks SET … GET; it needs %s or later", ErrRedisTooOld, v, minRedisVersion)
		}
		return nil
	}
	return errors.New("redis INFO server: no redis_version")
}
