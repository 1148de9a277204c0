package consumer_test

import (
	"context"
	"errors"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/pgsession"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/wire"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
)

// hotRowHandler credits one shared counter row for every event, then
// writes the event's ledger row; the event whose body is "poison" takes
// the row and hangs until its attempt runs out of time.
type hotRowHandler struct{ holding chan<- struct{} }

func (hotRowHandler) Decode(m consumer.Message) (guard.Event, string, error) {
	return guard.Event{ID: m.ID, Hash: guard.HashFields(string(m.Body)), Time: time.Now()}, string(m.Body), nil
}

func (h hotRowHandler) Apply(ctx context.Context, tx pgx.Tx, body string) error {
	if _, err := tx.Exec(ctx, `UPDATE balances SET balance = balance + 1 WHERE user_id = 'hot'`); err != nil {
		return err
	}
	if body == "poison" {
		select {
		case h.holding <- struct{}{}:
		default:
		}
		<-ctx.Done()
		return ctx.Err()
	}
	_, err := tx.Exec(ctx, `INSERT INTO ledger (event_id, user_id, amount) VALUES ($1, 'hot', 1)`, body)
	return err
}

// boundedPool bounds the consumer's sessions as idem.Service does (a
// lock_timeout of half the handler timeout), with a connection for each
// of the tests' eight workers and more.
func boundedPool(handlerTimeout time.Duration) func(*pgxpool.Config) {
	return func(c *pgxpool.Config) {
		c.MaxConns = 16
		pgsession.Apply(c, pgsession.Bounds{Tx: handlerTimeout})
	}
}

// TestAPoisonHoldingAHotRowTripsNothing: every event updates one counter
// row; a poison event takes its lock and hangs until its handler timeout.
// The good events queued on the row wait at their lock_timeout: that wait
// is the poison's doing, not theirs. Before, each such wait counted for
// the kill switch as a handler timeout, and five good events tripped it
// (events=5 share=100%): every delivery handed back, the poison with them
// unspent on every re-trip. Now such a wait never counts for the switch:
// the good events apply once the poison lets go, the poison alone is
// dead-lettered, and the switch never trips. (A good event still spends an
// attempt on each wait, as a handler that runs out of time does, so that
// one locked row holds up no worker for long.)
func TestAPoisonHoldingAHotRowTripsNothing(t *testing.T) {
	t.Parallel()
	const handlerTimeout, good = 3 * time.Second, 7
	holding := make(chan struct{}, 1)
	r, _, _ := startRigPool(t, hotRowHandler{holding: holding}, nil, boundedPool(handlerTimeout), func(cfg *consumer.Config) {
		cfg.Workers, cfg.Prefetch, cfg.BatchSize = 8, 16, 1
		cfg.HandlerTimeout, cfg.DeliveryLimit, cfg.StoreHold = handlerTimeout, 3, time.Minute
		cfg.KillSwitch = consumer.KillSwitch{Probe: consumer.Backoff{Min: 200 * time.Millisecond, Max: time.Second}}
	})
	_, err := r.pool.Exec(context.Background(), `INSERT INTO balances (user_id) VALUES ('hot')`)
	require.NoError(t, err)

	r.publish("evt_poison", "poison")
	select {
	case <-holding:
	case <-time.After(30 * time.Second):
		t.Fatal("the poison never took the row")
	}
	for i := range good {
		id := "evt_good_" + strconv.Itoa(i)
		r.publish(id, id)
	}
	r.requireLedger(good)
	var letters []amqp.Delivery
	require.Eventually(t, func() bool { letters = append(letters, r.dlqFor(50*time.Millisecond)...); return len(letters) > 0 },
		30*time.Second, time.Millisecond, "the poison was not dead-lettered")
	require.Len(t, letters, 1, "only the poison is dead-lettered: %s", describeLetters(letters))
	require.Equal(t, "evt_poison", letters[0].MessageId)
	require.Equal(t, wire.ReasonHandlerTimeout, letters[0].Headers[wire.HeaderReason])
	require.Zero(t, r.stats[wire.CounterKillSwitchTrips].Load(), "the good events waiting on the poison tripped the switch")
	require.Empty(t, r.consumerStats().Tripped)
}

// TestASilentStoreLinkTripsNothing: the consumer's link to Postgres goes
// silent (a blackhole) while transactions are in flight, so each runs out
// of its handler timeout in the claim, the handler's statements or the
// commit. Before, each counted as a handler timeout and the switch
// tripped (events=5 share=83%), then waited for its probe after the link
// healed. A store that does not answer is not the events' doing: they are
// held as the store unreachable, the switch never trips, and every event
// is applied once after the link heals.
//
// The handler timeout is 3 s: at 1 s, on a machine loaded by the rest of
// the suite under -race, transactions begun before the blackhole ran out
// of time on a store that answered (a CI run: four handler timeouts, a
// ping that answered, and a trip), which is the switch's job, not this
// test's subject. The handler ends with a statement after its wait, so
// that the transactions in flight hang in the handler's statements, not
// only in the guard's: without it, this test passed with the store's ping
// (storeAnswers) taken out.
func TestASilentStoreLinkTripsNothing(t *testing.T) {
	t.Parallel()
	const handlerTimeout = 3 * time.Second
	faults := sandbox.StartFaults()
	t.Cleanup(faults.Close)
	var link *sandbox.Link
	viaLink := func(c *pgxpool.Config) {
		var err error
		link, err = faults.Link("postgres", net.JoinHostPort(c.ConnConfig.Host, strconv.Itoa(int(c.ConnConfig.Port))))
		require.NoError(t, err)
		host, port, _ := net.SplitHostPort(link.Addr())
		p, err := strconv.Atoi(port)
		require.NoError(t, err)
		c.ConnConfig.Host, c.ConnConfig.Port = host, uint16(p)
		boundedPool(handlerTimeout)(c)
	}
	r, _, _ := startRigPool(t, slowHandler{d: 100 * time.Millisecond}, nil, viaLink, func(cfg *consumer.Config) {
		cfg.Workers, cfg.Prefetch, cfg.BatchSize = 8, 16, 1
		cfg.HandlerTimeout, cfg.DeliveryLimit, cfg.StoreHold = handlerTimeout, 2, 5*time.Second
		cfg.KillSwitch = consumer.KillSwitch{Probe: consumer.Backoff{Min: 30 * time.Second, Max: time.Minute}}
	})
	const events = 60
	for i := range 20 {
		r.publish("evt_"+strconv.Itoa(i), "b")
	}
	require.Eventually(t, func() bool { return r.stats[guard.OutcomeProcessed.String()].Load() >= 3 },
		30*time.Second, 5*time.Millisecond)
	require.NoError(t, link.Blackhole())
	for i := 20; i < events; i++ {
		r.publish("evt_"+strconv.Itoa(i), "b")
	}
	// Long enough for every transaction in flight to run out of time.
	time.Sleep(3 * handlerTimeout)
	require.NoError(t, link.Heal())
	r.requireLedgerWithin(events, time.Minute)
	require.Zero(t, r.stats[wire.CounterKillSwitchTrips].Load(), "a silent store tripped the switch")
	require.Empty(t, r.dlqFor(100*time.Millisecond), "nothing is dead-lettered for a silent store")
}

// slowHandler writes the event's ledger row, then takes d more in its
// transaction and runs one more statement, so that transactions are in
// flight, in the handler's statements, when a link goes silent.
type slowHandler struct{ d time.Duration }

func (slowHandler) Decode(m consumer.Message) (guard.Event, string, error) {
	return guard.Event{ID: m.ID, Hash: guard.HashFields(string(m.Body)), Time: time.Now()}, m.ID, nil
}

func (h slowHandler) Apply(ctx context.Context, tx pgx.Tx, id string) error {
	if _, err := tx.Exec(ctx, `INSERT INTO ledger (event_id, user_id, amount) VALUES ($1, 'u', 1)`, id); err != nil {
		return err
	}
	select {
	case <-time.After(h.d):
	case <-ctx.Done():
		return errors.Join(errors.New("slow handler"), ctx.Err())
	}
	// A second statement, so that a transaction in flight when the link
	// goes silent most likely hangs in the handler's own statement.
	_, err := tx.Exec(ctx, `SELECT 1`)
	return err
}
