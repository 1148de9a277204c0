package redistier

import (
	"context"
	"fmt"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
)

func TestCheckVersionRefusesRedisBefore7(t *testing.T) {
	for info, tooOld := range map[string]bool{
		"# Server\r\nredis_version:6.2.14\r\nredis_mode:standalone\r\n": true,
		"# Server\r\nredis_version:5.0.7\r\n":                           true,
		"# Server\r\nredis_version:7.0.15\r\n":                          false,
		"# Server\r\nredis_version:7.4.1\r\n":                           false,
		"# Server\r\nredis_version:8.0.0\r\n":                           false,
	} {
		err := checkVersion(info)
		if tooOld {
			require.ErrorIs(t, err, ErrRedisTooOld, info)
			require.ErrorContains(t, err, "7.0")
		} else {
			require.NoError(t, err, info)
		}
	}
	require.Error(t, checkVersion("# Server\r\n"))
	require.Error(t, checkVersion("redis_version:x.y\r\n"))
}

func TestCheckServerOnTheLocalRedis(t *testing.T) {
	rdb, _ := testenv.Redis(t)
	require.NoError(t, CheckServer(context.Background(), rdb))
}

// TestCheckServerRefusesADatabaseTheServerLacks: a client whose URL names a
// database number beyond the server's is a setting to fix
// (ErrNoSuchDatabase), while a server that does not answer stays a plain
// error, for the breaker.
func TestCheckServerRefusesADatabaseTheServerLacks(t *testing.T) {
	o, err := redis.ParseURL(testenv.RedisURL())
	require.NoError(t, err)
	o.DB, o.MaxRetries = 9999, -1
	rdb := redis.NewClient(o)
	defer rdb.Close()
	err = CheckServer(context.Background(), rdb)
	require.ErrorIs(t, err, ErrNoSuchDatabase)
	require.ErrorContains(t, err, "SELECT 9999")

	down := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t)), MaxRetries: -1})
	defer down.Close()
	err = CheckServer(context.Background(), down)
	require.Error(t, err)
	require.NotErrorIs(t, err, ErrNoSuchDatabase)
}
