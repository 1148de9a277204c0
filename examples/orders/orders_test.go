package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/pkg/idem/idemtest"
	"github.com/idemhq/idem/pkg/outbox"
)

// The services the tests run against: the environment's, or the local
// defaults.
func envDatabaseURL() string {
	return or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
}
func envAMQPURL() string { return or(os.Getenv("AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/") }

// notifications is the notifications API: it refuses a request without
// its bearer token, and acts on each Idempotency-Key once.
type notifications struct {
	*httptest.Server
	token   string
	mu      sync.Mutex
	notices map[string]Notice // by Idempotency-Key: the notice acted on
	repeats int               // requests with a key already acted on
	refused int               // requests without the token
}

func startNotifications(t *testing.T, token string) *notifications {
	api := &notifications{token: token, notices: map[string]Notice{}}
	api.Server = httptest.NewServer(http.HandlerFunc(api.serve))
	t.Cleanup(api.Close)
	return api
}

func (api *notifications) serve(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	api.mu.Lock()
	defer api.mu.Unlock()
	if r.Header.Get("Authorization") != "Bearer "+api.token {
		api.refused++
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	key := r.Header.Get("Idempotency-Key")
	if _, ok := api.notices[key]; ok {
		api.repeats++ // a relay that died before marking it sent
		return
	}
	var n Notice
	if err := json.Unmarshal(body, &n); err != nil {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	api.notices[key] = n
}

// acted returns the notices acted on, by Idempotency-Key.
func (api *notifications) acted() map[string]Notice {
	api.mu.Lock()
	defer api.mu.Unlock()
	out := make(map[string]Notice, len(api.notices))
	for k, n := range api.notices {
		out[k] = n
	}
	return out
}

// requireNotified requires that each of n events' customers got its notice,
// acted on once, and that no request came without the token.
func (api *notifications) requireNotified(t *testing.T, n int) {
	t.Helper()
	acted := api.acted()
	require.Len(t, acted, n)
	for i := range n {
		notice, ok := acted[outbox.ID("orders", fmt.Sprintf("shp_%06d", i), 0)]
		require.True(t, ok, "shipment %d was not notified", i)
		require.Equal(t, Notice{CustomerID: fmt.Sprintf("cus_%03d", i%97), OrderID: fmt.Sprintf("ord_%06d", i), Carrier: "DHL"}, notice)
	}
	api.mu.Lock()
	defer api.mu.Unlock()
	require.Zero(t, api.refused, "a request came without the token")
}

// TestEachShipmentNotifiesItsCustomerOnce: the service runs in this
// process with a notifications API that wants a bearer token. Its relay
// runs inside Run, declared in the service's own code: each shipment's
// notice arrives with the token, once per message ID, however often the
// event came.
func TestEachShipmentNotifiesItsCustomerOnce(t *testing.T) {
	t.Parallel()
	pool, dbURL := idemtest.Schema(t, envDatabaseURL())
	queue := idemtest.Stream(t, envAMQPURL())
	api := startNotifications(t, "s3cret")
	resp, err := http.Post(api.URL, "application/json", strings.NewReader(`{}`))
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusUnauthorized, resp.StatusCode, "the API wants its token")
	api.mu.Lock()
	api.refused = 0
	api.mu.Unlock()

	env := map[string]string{"DATABASE_URL": dbURL, "AMQP_URL": envAMQPURL(), "ORDERS_QUEUE": queue,
		"ORDERS_NOTIFY_URL": api.URL + "/v1/notices", "ORDERS_NOTIFY_TOKEN": "s3cret"}
	ctx, stop := context.WithCancel(context.Background())
	var runErr error
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		runErr = run(ctx, func(k string) string { return env[k] }, slog.New(slog.NewTextHandler(t.Output(), nil)))
	}()
	t.Cleanup(func() { stop(); <-finished })

	const n = 60
	var events [][]byte
	for i := range n {
		events = append(events, shipped(i))
	}
	idemtest.Publish(t, envAMQPURL(), queue, events...)
	idemtest.Publish(t, envAMQPURL(), queue, events[:n/3]...) // redelivered
	require.Eventually(t, func() bool { return len(api.acted()) == n }, 30*time.Second, 20*time.Millisecond,
		"the relay never notified every customer")
	stop() // SIGTERM, as it were
	<-finished
	require.NoError(t, runErr)

	api.requireNotified(t, n)
	var rows int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM shipments`).Scan(&rows))
	require.Equal(t, n, rows)
	require.Zero(t, idemtest.Depth(t, envAMQPURL(), queue+".dlq"), "an event was dead-lettered")
}

// TestEveryShipmentIsRecordedOnce is the exactly-once proof for a service
// built only on idem's public API: three processes of this command consume
// a stream in which a third of the events arrive twice and a tenth are
// replayed later; processes are SIGKILLed while they work and Redis dies
// for a while. In the end every event has exactly one shipments row,
// nothing is left in the queue and nothing was dead-lettered.
func TestEveryShipmentIsRecordedOnce(t *testing.T) {
	t.Parallel()
	bin := buildOrders(t)
	rs := startRedis(t)
	pool, dbURL := idemtest.Schema(t, envDatabaseURL())
	amqpURL := envAMQPURL()
	queue := idemtest.Stream(t, amqpURL)
	api := startNotifications(t, "s3cret")

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
		"ORDERS_NOTIFY_URL=" + api.URL, "ORDERS_NOTIFY_TOKEN=s3cret",
	}}
	for i := range 3 {
		f.start(i)
	}
	t.Cleanup(f.stopAll)
	idemtest.Publish(t, amqpURL, queue, stream[:len(stream)/2]...)

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
	idemtest.Publish(t, amqpURL, queue, stream[len(stream)/2:]...)
	<-chaos
	// Replays of a tenth of the events, once everything settled in.
	var replays [][]byte
	for i := 0; i < n; i += 10 {
		replays = append(replays, events[i])
	}
	idemtest.Publish(t, amqpURL, queue, replays...)

	require.Eventually(t, func() bool {
		var rows int
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM shipments`).Scan(&rows); err != nil {
			return false
		}
		return rows >= n && idemtest.Depth(t, amqpURL, queue) == 0 && len(api.acted()) >= n
	}, 90*time.Second, 200*time.Millisecond, "the fleet never caught up")
	f.stopAll() // SIGTERM: a clean drain acks the last deliveries

	var rows, distinct int
	require.NoError(t, pool.QueryRow(context.Background(),
		`SELECT count(*), count(DISTINCT event_id) FROM shipments`).Scan(&rows, &distinct))
	require.Equal(t, n, distinct, "an event was lost")
	require.Equal(t, n, rows, "an event was recorded twice")
	require.Zero(t, idemtest.Depth(t, amqpURL, queue), "the queue still holds events")
	require.Zero(t, idemtest.Depth(t, amqpURL, queue+".dlq"), "an event was dead-lettered")
	require.GreaterOrEqual(t, f.kills, 6)
	api.requireNotified(t, n)
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

// redisServer is a redis-server of the test's own, without persistence,
// to kill and start again on its port.
type redisServer struct {
	t    *testing.T
	port int
	cmd  *exec.Cmd
}

// startRedis starts one; it is killed at the end of the test. Without
// redis-server on this machine the test is skipped.
func startRedis(t *testing.T) *redisServer {
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Skip(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := &redisServer{t: t, port: ln.Addr().(*net.TCPAddr).Port}
	ln.Close()
	s.Start()
	t.Cleanup(s.Kill)
	return s
}

func (s *redisServer) URL() string { return fmt.Sprintf("redis://127.0.0.1:%d/0", s.port) }

// Start starts the server and waits until it takes connections.
func (s *redisServer) Start() {
	s.t.Helper()
	s.cmd = exec.Command("redis-server", "--port", strconv.Itoa(s.port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", s.t.TempDir())
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	require.NoError(s.t, s.cmd.Start())
	require.Eventually(s.t, func() bool {
		c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", s.port), time.Second)
		if err == nil {
			c.Close()
		}
		return err == nil
	}, 10*time.Second, 20*time.Millisecond, "redis-server did not start")
}

// Kill SIGKILLs the server, losing every key.
func (s *redisServer) Kill() {
	if s.cmd != nil {
		_ = s.cmd.Process.Kill()
		_ = s.cmd.Wait()
		s.cmd = nil
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
