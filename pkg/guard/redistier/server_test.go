package redistier

import (
	"context"
	"testing"

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
