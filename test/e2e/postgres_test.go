package e2e

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
)

// TestPostgresDownNothingAckedNothingLost stops a test-owned PostgreSQL
// (immediate mode: every session cut, open transactions lost) while two
// consumers work, and starts it again. Consumers must hold their deliveries,
// retry in place, dead-letter nothing, and end with every event applied once.
func TestPostgresDownNothingAckedNothingLost(t *testing.T) {
	t.Parallel()
	testenv.Shared(t) // before its Postgres starts, not only in newEnv
	pg := testenv.StartPostgres(t)
	e := newEnvOn(t, "", "", pg.URL())
	e.consume("c0")
	e.consume("c1")
	published := e.publishAsync(2000, 0.25, 1000)

	e.waitRows(300)
	pg.Stop()
	e.waitLog("store unavailable, retrying in place")
	pg.Start()

	m := <-published
	e.waitApplied(m)
	stats := e.stopAll()
	require.Zero(t, stats["dead_lettered"], "an outage of Postgres is no reason to dead-letter: %v", stats)
	require.Equal(t, 0, testenv.QueueDepth(t, e.amqpURL, e.queue+".dlq"))
	e.requireExactlyOnce(m)
}
