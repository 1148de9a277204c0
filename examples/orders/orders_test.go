package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/broker"
	"github.com/idemhq/idem/internal/testenv"
)

// TestEveryShipmentIsRecordedOnce is the exactly-once proof for a service
// built only on idem's public API: three processes of this command consume
// a stream in which a third of the events arrive twice and a tenth are
// replayed later; processes are SIGKILLed while they work and Redis dies
// for a while. In the end every event has exactly one shipments row,
// nothing is left in the queue and nothing was dead-lettered.
func TestEveryShipmentIsRecordedOnce(t *testing.T) {
	t.Parallel()
	bin := buildOrders(t)
	rs := testenv.StartRedis(t)
	pool, dbURL := testenv.EmptySchema(t)
	amqpURL := testenv.AMQPURL()
	queue := testenv.Queue(t, amqpURL)

	// The stream: every event once, a third of them twice in a row.
	const n = 3000
	events := make([][]byte, n)
	for i := range events {
		events[i] = shipped(i)
	}
	var stream [][]byte
	for i, b := range events {
		stream = append(stream, b)
		if i%3 == 0 {
			stream = append(stream, b)
		}
	}

	f := &fleet{t: t, bin: bin, env: []string{
		"DATABASE_URL=" + dbURL, "AMQP_URL=" + amqpURL, "REDIS_URL=" + rs.URL(), "ORDERS_QUEUE=" + queue,
	}}
	for i := range 3 {
		f.start(i)
	}
	t.Cleanup(f.stopAll)
	publish(t, amqpURL, queue, stream[:len(stream)/2])

	// Faults while the second half arrives: SIGKILLs, and Redis down.
	chaos := make(chan struct{})
	go func() {
		defer close(chaos)
		rng := rand.New(rand.NewPCG(1, 2))
		for k := range 6 {
			time.Sleep(time.Duration(300+rng.IntN(500)) * time.Millisecond)
			f.kill(rng.IntN(3))
			if k == 2 {
				rs.Kill()
				time.Sleep(2 * time.Second)
				rs.Start()
			}
		}
	}()
	publish(t, amqpURL, queue, stream[len(stream)/2:])
	<-chaos
	// Replays of a tenth of the events, once everything settled in.
	var replays [][]byte
	for i := 0; i < n; i += 10 {
		replays = append(replays, events[i])
	}
	publish(t, amqpURL, queue, replays)

	require.Eventually(t, func() bool {
		var rows int
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM shipments`).Scan(&rows); err != nil {
			return false
		}
		return rows >= n && testenv.QueueDepth(t, amqpURL, queue) == 0
	}, 90*time.Second, 200*time.Millisecond, "the fleet never caught up")
	f.stopAll() // SIGTERM: a clean drain acks the last deliveries

	var rows, distinct int
	require.NoError(t, pool.QueryRow(context.Background(),
		`SELECT count(*), count(DISTINCT event_id) FROM shipments`).Scan(&rows, &distinct))
	require.Equal(t, n, distinct, "an event was lost")
	require.Equal(t, n, rows, "an event was recorded twice")
	require.Zero(t, testenv.QueueDepth(t, amqpURL, queue), "the queue still holds events")
	require.Zero(t, testenv.QueueDepth(t, amqpURL, queue+".dlq"), "an event was dead-lettered")
	require.GreaterOrEqual(t, f.kills, 6)
}

func shipped(i int) []byte {
	b, _ := json.Marshal(Shipped{
		EventID: fmt.Sprintf("shp_%06d", i), OrderID: fmt.Sprintf("ord_%06d", i), CustomerID: fmt.Sprintf("cus_%03d", i%97),
		Type: TypeOrderShipped, Carrier: "DHL", ShippedAt: time.Now().UTC(),
	})
	return b
}

// buildOrders builds this command into the test's temporary directory.
func buildOrders(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "orders")
	out, err := exec.Command("go", "build", "-race", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	return bin
}

// publish sends bodies to queue with publisher confirms, after declaring
// the topology the consumers declare.
func publish(t *testing.T, amqpURL, queue string, bodies [][]byte) {
	t.Helper()
	conn, err := amqp.Dial(amqpURL)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, broker.TopologyFor(queue, 0).Declare(ch))
	require.NoError(t, ch.Confirm(false))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var pending []*amqp.DeferredConfirmation
	for _, b := range bodies {
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, true, false, amqp.Publishing{
			ContentType: "application/json", DeliveryMode: amqp.Persistent, Body: b})
		require.NoError(t, err)
		pending = append(pending, dc)
	}
	for _, dc := range pending {
		ok, err := dc.WaitContext(ctx)
		require.NoError(t, err)
		require.True(t, ok, "the broker nacked a publish")
	}
}

// fleet runs copies of the command, each in its slot.
type fleet struct {
	t     *testing.T
	bin   string
	env   []string
	mu    sync.Mutex
	procs map[int]*exec.Cmd
	kills int
}

func (f *fleet) start(slot int) {
	f.t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.procs == nil {
		f.procs = map[int]*exec.Cmd{}
	}
	log, err := os.Create(filepath.Join(f.t.TempDir(), fmt.Sprintf("orders-%d-%d.log", slot, f.kills)))
	require.NoError(f.t, err)
	cmd := exec.Command(f.bin)
	cmd.Env = append(os.Environ(), f.env...)
	cmd.Stdout, cmd.Stderr = log, log
	require.NoError(f.t, cmd.Start())
	f.procs[slot] = cmd
	// Up once it consumes: a SIGTERM before then would find no handler.
	require.Eventually(f.t, func() bool {
		b, _ := os.ReadFile(log.Name())
		return strings.Contains(string(b), `"msg":"consuming"`)
	}, 60*time.Second, 20*time.Millisecond, "orders %d never started consuming", slot)
}

// kill SIGKILLs the process in slot and starts another in its place.
func (f *fleet) kill(slot int) {
	f.mu.Lock()
	cmd := f.procs[slot]
	f.kills++
	f.mu.Unlock()
	_ = cmd.Process.Signal(syscall.SIGKILL)
	_ = cmd.Wait()
	f.start(slot)
}

// stopAll sends SIGTERM to every process and requires a clean exit.
func (f *fleet) stopAll() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for slot, cmd := range f.procs {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		if err := cmd.Wait(); err != nil && !f.t.Failed() {
			out, _ := os.ReadFile(cmd.Stdout.(*os.File).Name())
			f.t.Errorf("orders %d did not drain cleanly: %v\n%s", slot, err, out)
		}
	}
	f.procs = nil
}
