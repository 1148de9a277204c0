package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/crashpoint"
	"github.com/idemhq/idem/internal/fleet"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/internal/verify"
)

// TestFleetUnderFire is the "done when" run: tens of thousands of
// events with a quarter duplicated, four consumers, and a seeded schedule of
// faults while they work: consumers SIGKILLed at random moments and at named
// crash points (and restarted), the test's Redis killed, restarted and
// flushed, the consumers' Postgres sessions terminated, and their RabbitMQ
// connections closed. Every distinct event must end applied exactly once.
//
// IDEM_FIRE_EVENTS and IDEM_FIRE_SEED change the size and the schedule.
func TestFleetUnderFire(t *testing.T) {
	t.Parallel()
	events := envInt("IDEM_FIRE_EVENTS", 20000)
	seed := uint64(envInt("IDEM_FIRE_SEED", int(time.Now().UnixNano()%1e9)))
	t.Logf("seed %d (rerun with IDEM_FIRE_SEED=%d)", seed, seed)
	rng := rand.New(rand.NewPCG(seed, 7))

	rs := testenv.StartRedis(t)
	e := newEnv(t, rs.URL(), testenv.VHost(t))
	live := map[int]*fleet.Proc{}
	next := 0
	start := func(slot int, extra ...string) {
		live[slot] = e.consume(fmt.Sprintf("c%d-%d", slot, next), extra...)
		next++
	}
	for slot := range 4 {
		start(slot)
	}
	published := e.publishAsync(events, 0.25, 4000)

	type fault struct {
		name string
		run  func()
	}
	kill := func() {
		slot := rng.IntN(len(live))
		live[slot].Kill()
		start(slot)
	}
	armed := func() {
		slot := rng.IntN(len(live))
		live[slot].Kill()
		step := crashpoint.Steps[rng.IntN(len(crashpoint.Steps))]
		start(slot, crashpoint.EnvAt+"="+string(step), crashpoint.EnvAfter+"="+strconv.Itoa(1+rng.IntN(200)))
	}
	redisDown := func() {
		rs.Kill()
		e.waitRows(e.ledgerRows() + 200)
		rs.Start()
	}
	flush := func() {
		rdb := rs.Client()
		defer rdb.Close()
		require.NoError(t, rdb.FlushAll(context.Background()).Err())
	}
	terminatePG := func() {
		_, err := e.pool.Exec(context.Background(),
			`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1`, e.appName)
		require.NoError(t, err)
	}
	closeAMQP := func() { testenv.CloseConnections(t, e.amqpURL) }
	duringPublish := []fault{{"kill", kill}, {"armed crash", armed}, {"redis down", redisDown},
		{"redis flush", flush}, {"postgres terminate", terminatePG}, {"kill", kill}, {"armed crash", armed}}
	// Closing every connection of the vhost would also cut the publisher,
	// which does not reconnect: that fault waits until publishing is done.
	afterPublish := []fault{{"amqp close", closeAMQP}, {"kill", kill}, {"postgres terminate", terminatePG},
		{"redis flush", flush}, {"amqp close", closeAMQP}}

	rng.Shuffle(len(duringPublish), func(i, j int) { duringPublish[i], duringPublish[j] = duringPublish[j], duringPublish[i] })
	step := events / 20
	for i, f := range duringPublish {
		e.waitRows((i + 1) * step)
		t.Logf("fault %d: %s", i, f.name)
		f.run()
	}
	m := <-published
	for i, f := range afterPublish {
		e.waitRows(events/2 + (i+1)*step)
		t.Logf("fault %d: %s", len(duringPublish)+i, f.name)
		f.run()
	}
	// Replace any consumer that died of its armed crash point after the
	// last fault, so the fleet can finish.
	for slot, p := range live {
		select {
		case <-p.Done():
			start(slot)
		default:
		}
	}
	r, err := verify.Wait(context.Background(), e.pool, m, 120*time.Second)
	require.NoError(t, err)
	require.True(t, r.OK(), "%+v", r)
	stats := e.stopAll()
	t.Logf("surviving consumers' outcomes: %v", stats)
	reconnected := false
	for _, p := range e.procs {
		b, _ := os.ReadFile(p.LogPath)
		reconnected = reconnected || strings.Contains(string(b), "amqp session ended, reconnecting")
	}
	require.True(t, reconnected, "closing the AMQP connections must have made some consumer reconnect")
	e.requireExactlyOnce(m)
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}
