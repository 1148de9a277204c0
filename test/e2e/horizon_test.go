package e2e

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/wire"
)

// TestUntimedEventsByDefault: the seed's own event carries no time, and most
// producers set no AMQP timestamp. By default such events are processed
// while nothing was ever pruned; prune refuses the first cut while they keep
// arriving; after a cut they are refused unless their row exists. None is
// applied twice at any point.
func TestUntimedEventsByDefault(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	e.vars = append(e.vars, "IDEM_REDIS_ENABLED=false") // Postgres alone decides
	c := e.consume("c0")
	e.waitConsuming(c)

	seed := body(`{"eventId":"evt_12345","userId":"user_42","type":"PAYMENT_COMPLETED","amount":1000}`)
	seed.MessageId, seed.Timestamp = "m_seed", untimed
	e.publishRaw(seed)
	e.waitRows(1)
	again := seed
	again.MessageId = "m_seed_again"
	e.publishRaw(again)

	refused := e.run(nil, "prune")
	require.Equal(t, 1, refused.code, refused.out)
	require.Contains(t, refused.out, "events without a time are still being claimed")
	cut := e.run(nil, "prune", "--cut-untimed")
	require.Equal(t, 0, cut.code, cut.out)

	// After the cut: a new untimed event is refused; the seed's row still
	// exists, so its copy is a duplicate; a timed event goes through.
	fresh := body(`{"eventId":"evt_new","userId":"user_42","type":"PAYMENT_COMPLETED","amount":5}`)
	fresh.MessageId, fresh.Timestamp = "m_new_untimed", untimed
	third := seed
	third.MessageId = "m_seed_third"
	timed := body(`{"eventId":"evt_timed","userId":"user_42","type":"PAYMENT_COMPLETED","amount":7}`)
	e.publishRaw(fresh, third, timed)
	letters := e.deadLetters(1)
	require.Equal(t, "m_new_untimed", letters[0].MessageId)
	require.Equal(t, wire.ReasonMissingTime, letters[0].Headers[wire.HeaderReason])
	e.waitRows(2)

	stats := e.stopAll()
	require.Equal(t, int64(2), stats["processed"], "%v", stats)
	require.Equal(t, int64(2), stats["duplicate_postgres"], "%v", stats)
	require.Equal(t, int64(1007), e.balance("user_42"), "an untimed event was applied twice, or a good one lost")
	require.Equal(t, 2, e.ledgerRows())
}

// TestAZeroClockSkewIsRefused: clock_skew 0 was recorded as 0 while the
// consumer enforced its 5-minute default, so prune cut rows still inside
// the consumer's horizon.
func TestAZeroClockSkewIsRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	for _, cmd := range []string{"consume", "prune"} {
		r := e.run([]string{"IDEM_CONSUMER_CLOCK_SKEW=0s"}, cmd)
		require.NotZero(t, r.code, r.out)
		require.Contains(t, r.out, "consumer.clock_skew: 0s is out of range", cmd)
	}
}
