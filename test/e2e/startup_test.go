package e2e

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/testenv"
)

// TestStartupSaysWhatIsWrongAndStops: an error that cannot fix itself ends
// `idem consume` with exit 1 and a message naming the setting and the
// cause, long before the start-up deadline (30s here; e.run fails the test
// if a command runs for a minute). Before, each of these logged "consuming"
// or nothing and retried for ever. RabbitMQ refusing the connection exits
// 2, a setting to fix, once the refusal has repeated for a few seconds (a
// broker restarting drops handshakes too, and amqp091 reports a dropped one
// as bad credentials).
func TestStartupSaysWhatIsWrongAndStops(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	ctx := context.Background()

	// A schema whose idem_processed predates the migration ledger: the
	// first migration fails with 42P07.
	stalePool, stale := testenv.Schema(t, payments.Migrations)
	_, err := stalePool.Exec(ctx, `DROP TABLE idem_migrations`)
	require.NoError(t, err)

	busy, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer busy.Close()
	closed := testenv.FreePort(t)
	amqpUser := func(userinfo string) string {
		return strings.Replace(e.amqpURL, "guest:guest", userinfo, 1)
	}

	refusedAfterRetries := []string{"msg=\"amqp session refused, reconnecting\"", "dropped it during the handshake",
		"amqp_url: RabbitMQ refused the connection (check the URL's user, password and vhost)"}
	cases := []struct {
		name     string
		env      []string
		contains []string
		code     int // exit status
	}{
		{"AMQP bad password", []string{"AMQP_URL=" + amqpUser("guest:wrong")}, append([]string{"403"}, refusedAfterRetries...), 2},
		{"AMQP missing vhost", []string{"AMQP_URL=" + strings.TrimSuffix(e.amqpURL, "/") + "/no_such_vhost"}, refusedAfterRetries, 2},
		{"AMQP http scheme", []string{"AMQP_URL=http://guest:guest@127.0.0.1:5672/"}, []string{"amqp_url", "cannot be parsed"}, 1},
		{"AMQP unparseable", []string{"AMQP_URL=amqp://guest:guest@127.0.0.1:notaport/"}, []string{"amqp_url", "cannot be parsed"}, 1},
		{"migration 42P07", []string{"DATABASE_URL=" + stale}, []string{"migrations failed, and retrying cannot fix it", "42P07"}, 1},
		{"schema missing (3F000)", []string{"DATABASE_URL=" + testenv.WithParam(testenv.DatabaseURL(), "search_path", "no_such_schema_idem")}, []string{"retrying cannot fix it", "3F000"}, 1},
		{"database missing", []string{"DATABASE_URL=postgres://postgres@127.0.0.1:5432/no_such_db_idem?sslmode=disable"}, []string{"retrying cannot fix it", "3D000"}, 1},
		{"metrics_addr taken", []string{"IDEM_METRICS_ADDR=" + busy.Addr().String()}, []string{"metrics_addr", "address already in use"}, 1},
		{"metrics_addr malformed", []string{"IDEM_METRICS_ADDR=nohost:port:x"}, []string{"metrics_addr"}, 1},
		{"misspelt variable", []string{"IDEM_CONSUMER_WORKRS=4"}, []string{"IDEM_CONSUMER_WORKRS names no setting"}, 1},
		// A service that is not up is waited for, visibly, until the deadline.
		{"Postgres not up", []string{"DATABASE_URL=postgres://postgres@127.0.0.1:" + fmt.Sprint(closed) + "/test?sslmode=disable", "IDEM_CONSUMER_STARTUP_TIMEOUT=2s"},
			[]string{"waiting for PostgreSQL", "PostgreSQL was not reachable within the start-up timeout (2s)"}, 1},
		{"RabbitMQ not up", []string{"AMQP_URL=amqp://guest:guest@127.0.0.1:" + fmt.Sprint(closed) + "/", "IDEM_CONSUMER_STARTUP_TIMEOUT=2s"},
			[]string{"amqp_url: RabbitMQ was not reachable within StartupTimeout (2s)"}, 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := e.run(append([]string{"IDEM_CONSUMER_STARTUP_TIMEOUT=30s"}, c.env...), "consume")
			require.Equal(t, c.code, r.code, r.out)
			for _, s := range c.contains {
				require.Contains(t, r.out, s)
			}
			require.NotContains(t, r.out, "msg=consuming")
		})
	}
}

// TestConsumerWaitsForAPostgresThatIsNotUpYet: a fleet may start before its
// database; the consumer waits, saying so, and consumes once it is up.
func TestConsumerWaitsForAPostgresThatIsNotUpYet(t *testing.T) {
	t.Parallel()
	testenv.Shared(t) // before its Postgres starts, not only in newEnv
	pg := testenv.StartPostgres(t)
	e := newEnvOn(t, "", "", pg.URL())
	pg.Stop()
	c := e.consume("c0")
	e.waitLog("waiting for PostgreSQL")
	pg.Start()
	e.pool.Reset() // its connections died with the server
	e.waitConsuming(c)
	e.publishRaw(payment("evt_late", "user_1", 3))
	e.waitRows(1)
	e.stopAll()
}

// TestShardListKeepsItsOrder: once migrated as shard 0 and shard 1, two
// databases listed the other way round stop a consumer at start, naming
// the setting, as does a partition the stream does not have.
func TestShardListKeepsItsOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	_, s0 := testenv.Schema(t, payments.Migrations)
	_, s1 := testenv.Schema(t, payments.Migrations)
	r := e.run([]string{"IDEM_POSTGRES_SHARDS=" + s0 + " " + s1}, "migrate")
	require.Equal(t, 0, r.code, r.out)
	require.Contains(t, r.out, "shard 1 is up to date")

	r = e.run([]string{"IDEM_POSTGRES_SHARDS=" + s1 + " " + s0, "IDEM_CONSUMER_STARTUP_TIMEOUT=30s"}, "consume")
	require.Equal(t, 1, r.code, r.out)
	require.Contains(t, r.out, "shard 0")
	require.Contains(t, r.out, "was set up as shard 1 of 2, and is now listed as shard 0 of 2")
	require.NotContains(t, r.out, "msg=consuming")

	r = e.run([]string{"IDEM_PARTITIONS=4"}, "consume", "--partition", "1,4")
	require.Equal(t, 1, r.code, r.out)
	require.Contains(t, r.out, "--partition 4: the stream has 4 partition(s), 0 to 3")
}
