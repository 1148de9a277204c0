package consumer_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/pgsession"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
)

// deployPool bounds the consumer's sessions as idem.Service does (a
// lock_timeout of half the handler timeout), with maxConns connections.
func deployPool(maxConns int32, handlerTimeout time.Duration, extra map[string]string) func(*pgxpool.Config) {
	return func(c *pgxpool.Config) {
		c.MaxConns = maxConns
		pgsession.Apply(c, pgsession.Bounds{Tx: handlerTimeout})
		for k, v := range extra {
			c.ConnConfig.RuntimeParams[k] = v
		}
	}
}

// deployHandler: an event whose body is "hang" hangs until its attempt runs
// out of time (hangAll: every event does); every other event credits the
// balances row 'u' and writes its ledger row.
type deployHandler struct{ hangAll bool }

func (deployHandler) Decode(m consumer.Message) (guard.Event, string, error) {
	return guard.Event{ID: m.ID, Hash: guard.HashFields(string(m.Body)), Time: time.Now()}, string(m.Body), nil
}

func (h deployHandler) Apply(ctx context.Context, tx pgx.Tx, body string) error {
	if h.hangAll || body == "hang" {
		<-ctx.Done()
		return ctx.Err()
	}
	if _, err := tx.Exec(ctx, `UPDATE balances SET balance = balance + 1 WHERE user_id = 'u'`); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, `INSERT INTO ledger (event_id, user_id, amount) VALUES ($1, 'u', 1)`, body)
	return err
}

// TestADeployMigrationLockDeadLettersNothing: a deploy's migration
// holds a business table locked (ALTER TABLE, a non-concurrent CREATE
// INDEX) for longer than an event's attempts take. Every handler statement
// is cancelled by lock_timeout (55P03). A wait is not the event's failure,
// but one that outlasts a handler timeout is no poison event's either:
// the switch trips, and nothing is dead-lettered. (A first cut that never
// counted a wait dead-lettered all ten as handler_timeout.)
func TestADeployMigrationLockDeadLettersNothing(t *testing.T) {
	t.Parallel()
	const handlerTimeout, events = time.Second, 10
	r, _, _ := startRigPool(t, deployHandler{}, nil, deployPool(16, handlerTimeout, nil), func(cfg *consumer.Config) {
		cfg.Workers, cfg.Prefetch, cfg.BatchSize = 4, 16, 1
		cfg.HandlerTimeout, cfg.DeliveryLimit, cfg.StoreHold = handlerTimeout, 3, time.Minute
		cfg.KillSwitch = consumer.KillSwitch{Probe: consumer.Backoff{Min: time.Second, Max: 2 * time.Second}}
	})
	ctx := context.Background()
	_, err := r.pool.Exec(ctx, `INSERT INTO balances (user_id) VALUES ('u')`)
	require.NoError(t, err)
	migration, err := r.pool.Begin(ctx)
	require.NoError(t, err)
	_, err = migration.Exec(ctx, `LOCK TABLE balances IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	for i := range events {
		r.publish("evt_"+strconv.Itoa(i), "good"+strconv.Itoa(i))
	}
	letters := r.dlqFor(12 * time.Second)
	require.NoError(t, migration.Rollback(ctx))
	require.Zero(t, len(letters), "the stream was dead-lettered while a migration held its table: %s", describeLetters(letters))
	r.requireLedgerWithin(events, time.Minute)
}

// TestEveryEventHangsTrips: a deploy whose handler hangs on every
// event, with the pool the library allows (warned, not refused) when it is
// no larger than the workers, and with one with room. The ping asked after
// each handler timeout (storeAnswers) must not wait for a connection so
// long behind the hung handlers that each hang reads as the store
// unreachable and is never counted: the switch trips either way.
func TestEveryEventHangsTrips(t *testing.T) {
	for name, conns := range map[string]int32{"pool smaller than workers": 2, "one connection": 1, "control: pool with room": 16} {
		t.Run(name, func(t *testing.T) {
			const handlerTimeout = time.Second
			r, _, _ := startRigPool(t, deployHandler{hangAll: true}, nil, deployPool(conns, handlerTimeout, nil), func(cfg *consumer.Config) {
				cfg.Workers, cfg.Prefetch, cfg.BatchSize = 4, 16, 1
				cfg.HandlerTimeout, cfg.DeliveryLimit, cfg.StoreHold = handlerTimeout, 3, 3*time.Second
				cfg.KillSwitch = consumer.KillSwitch{Probe: consumer.Backoff{Min: time.Minute, Max: time.Minute}}
			})
			for i := range 30 {
				r.publish("evt_"+strconv.Itoa(i), "x"+strconv.Itoa(i))
			}
			require.Eventually(t, func() bool { return r.stats[wire.CounterKillSwitchTrips].Load() > 0 },
				40*time.Second, 20*time.Millisecond,
				"a deploy whose every event hangs never tripped the switch (store retries %d, tripped %q)",
				r.stats[wire.CounterStoreRetry].Load(), r.consumerStats().Tripped)
		})
	}
}

// TestAMostlyHangingDeployTrips: a deploy broken for 60% of the
// events (their handler hangs), the rest applied. The switch's rate
// compares the events that failed with the events settled, each counted
// for itself: the concurrent hangs that count as one event in the streak
// (hangOf) still count one by one in the share, or it stays under Rate and
// the hanging events are dead-lettered, as a first cut did.
func TestAMostlyHangingDeployTrips(t *testing.T) {
	t.Parallel()
	const handlerTimeout = time.Second
	r, _, _ := startRigPool(t, deployHandler{}, nil, deployPool(16, handlerTimeout, nil), func(cfg *consumer.Config) {
		cfg.Workers, cfg.Prefetch, cfg.BatchSize = 8, 16, 1
		cfg.HandlerTimeout, cfg.DeliveryLimit, cfg.StoreHold = handlerTimeout, 2, time.Minute
		cfg.KillSwitch = consumer.KillSwitch{Probe: consumer.Backoff{Min: time.Minute, Max: time.Minute}}
	})
	_, err := r.pool.Exec(context.Background(), `INSERT INTO balances (user_id) VALUES ('u')`)
	require.NoError(t, err)
	for i := range 50 {
		body := "good" + strconv.Itoa(i)
		if i%5 < 3 {
			body = "hang"
		}
		r.publish("evt_"+strconv.Itoa(i), body)
	}
	letters := r.dlqFor(20 * time.Second)
	require.Zero(t, len(letters), "a deploy broken for 60%% of the events dead-lettered them (trips %d): %s",
		r.stats[wire.CounterKillSwitchTrips].Load(), describeLetters(letters))
	require.NotZero(t, r.stats[wire.CounterKillSwitchTrips].Load(), "the switch never tripped")
}

// TestAReadOnlyStoreIsNotHeldForever: a deploy pointed at a read replica
// (or a role with default_transaction_read_only): every claim fails 25006.
// Held as a store away, each delivery would be handed back after StoreHold
// and the session would start again at once (BEGIN and ROLLBACK, the ping,
// pass on a standby), every hand-back a delivery the broker counts, until
// it dead-letters the stream without a reason. It is store_failed, class
// 25006: the switch trips and holds the stream until the pool reaches a
// primary.
func TestAReadOnlyStoreIsNotHeldForever(t *testing.T) {
	t.Parallel()
	const handlerTimeout = time.Second
	r, _, _ := startRigPool(t, deployHandler{}, nil,
		deployPool(16, handlerTimeout, map[string]string{"default_transaction_read_only": "on"}),
		func(cfg *consumer.Config) {
			cfg.Workers, cfg.Prefetch, cfg.BatchSize = 4, 16, 1
			cfg.HandlerTimeout, cfg.DeliveryLimit, cfg.BrokerDeliveryLimit, cfg.StoreHold = handlerTimeout, 2, 4, time.Second
			cfg.KillSwitch = consumer.KillSwitch{Probe: consumer.Backoff{Min: time.Minute, Max: time.Minute}}
		})
	for i := range 10 {
		r.publish("evt_"+strconv.Itoa(i), "good"+strconv.Itoa(i))
	}
	letters := r.dlqFor(20 * time.Second)
	t.Logf("trips %d, store retries %d, dead letters %d:%s", r.stats[wire.CounterKillSwitchTrips].Load(),
		r.stats[wire.CounterStoreRetry].Load(), len(letters), describeLetters(letters))
	require.Zero(t, len(letters), "a read-only store dead-lettered the stream through the broker's limit")
	require.NotZero(t, r.stats[wire.CounterKillSwitchTrips].Load(), "a store that refuses every write never tripped the switch")
}
