package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
)

// scrape is one read of a consumer's /metrics.
type scrape map[string]*dto.MetricFamily

// scrapeMetrics reads and parses http://addr/metrics.
func scrapeMetrics(t *testing.T, addr string) scrape {
	t.Helper()
	s, err := tryScrape(addr)
	require.NoError(t, err)
	return s
}

// tryScrape is scrapeMetrics for a consumer that may not serve yet.
func tryScrape(addr string) (scrape, error) {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("/metrics: %s", resp.Status)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	return parser.TextToMetricFamilies(resp.Body)
}

// value sums the series of family name whose labels include labels (pairs
// of name and value): a counter's or gauge's value, a histogram's count.
func (s scrape) value(name string, labels ...string) float64 {
	f, ok := s[name]
	if !ok {
		return -1
	}
	var sum float64
next:
	for _, m := range f.GetMetric() {
		have := map[string]string{}
		for _, l := range m.GetLabel() {
			have[l.GetName()] = l.GetValue()
		}
		for i := 0; i+1 < len(labels); i += 2 {
			if have[labels[i]] != labels[i+1] {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			sum += m.GetCounter().GetValue()
		case m.Gauge != nil:
			sum += m.GetGauge().GetValue()
		case m.Histogram != nil:
			sum += float64(m.GetHistogram().GetSampleCount())
		case m.Untyped != nil:
			sum += m.GetUntyped().GetValue()
		}
	}
	return sum
}

// histogramSum is the sum of the observations of histogram name.
func (s scrape) histogramSum(name string) float64 {
	var sum float64
	for _, m := range s[name].GetMetric() {
		sum += m.GetHistogram().GetSampleSum()
	}
	return sum
}

// get fetches a probe and returns its status and body.
func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestMetricsAfterAKnownStream runs one consumer on a test-owned Redis
// through a stream whose every outcome is known (new events, duplicates
// dropped by Redis, bad input, a payload conflict, a Redis outage that opens
// the breaker, duplicates caught by Postgres, new events during the outage),
// then checks every idem metric by name and value, the probes, and that each
// metric the Grafana dashboard queries exists.
func TestMetricsAfterAKnownStream(t *testing.T) {
	t.Parallel()
	rs := testenv.StartRedis(t)
	e := newEnv(t, rs.URL(), "")
	addr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	// The breaker stays open once open, so the scrape sees it open.
	// With a relay beside it (the dashboard's outbox panels read its
	// metrics); the handler sends nothing, so it relays nothing. The
	// stream's counts need every Redis call to answer: a done marker
	// whose write missed the 50 ms default on a loaded machine is not
	// written again (a CI run waited for 40 markers and saw fewer), so
	// calls get a second, which a killed Redis still fails at once.
	e.consume("c0", "IDEM_METRICS_ADDR="+addr, "IDEM_REDIS_BREAKER_OPEN_TIMEOUT=10m", "IDEM_REDIS_TIMEOUT=1s",
		"IDEM_OUTBOX_RELAY=true", "IDEM_OUTBOX_DESTINATIONS=receipts=queue:"+e.queue+".receipts")
	ok := func(id, amount string) amqp.Publishing {
		return body(`{"eventId":"` + id + `","userId":"user_1","type":"PAYMENT_COMPLETED","amount":` + amount + `}`)
	}
	until := func(what string, cond func(s scrape) bool) scrape {
		t.Helper()
		var s scrape
		require.Eventually(t, func() bool {
			var err error
			s, err = tryScrape(addr) // the consumer may not serve yet
			return err == nil && cond(s)
		}, 60*time.Second, 20*time.Millisecond, what)
		return s
	}
	processed := func(s scrape) float64 { return s.value("idem_deliveries_total", "outcome", "processed") }

	// 1. 40 new events, then their done markers in Redis.
	const n = 40
	var first []amqp.Publishing
	for i := range n {
		first = append(first, ok(fmt.Sprintf("evt_m%d", i), "10"))
	}
	e.publishRaw(first...)
	until("40 processed", func(s scrape) bool { return processed(s) == n })
	rdb := rs.Client()
	defer rdb.Close()
	require.Eventually(t, func() bool { // the Redis is the test's own
		keys, _ := rdb.Keys(context.Background(), "*").Result()
		done := 0
		for _, k := range keys {
			if v, _ := rdb.Get(context.Background(), k).Result(); strings.HasPrefix(v, "done:") {
				done++
			}
		}
		return done == n
	}, 30*time.Second, 20*time.Millisecond, "done markers")

	// 2. The same 40 again: Redis drops them.
	e.publishRaw(first...)
	until("40 dropped by Redis", func(s scrape) bool { return s.value("idem_deliveries_total", "outcome", "duplicate_redis") == n })

	// 3. Bad input and a payload conflict.
	e.publishRaw(body(`{"eventId":`), ok("evt_m0", "999"))
	until("2 dead letters", func(s scrape) bool { return s.value("idem_dead_letters_total") == 2 })

	// 4. Redis dies. Copies go to Postgres, one at a time, until the
	// breaker has seen the outage last and opened.
	rs.Kill()
	dups := 0
	for ; dups < 400; dups++ {
		e.publishRaw(first[dups%n])
		if scrapeMetrics(t, addr).value("idem_breaker_open") == 1 {
			dups++
			break
		}
	}
	require.Equal(t, 1.0, scrapeMetrics(t, addr).value("idem_breaker_open"), "the outage never opened the breaker")

	// 5. New events while Redis is down.
	var more []amqp.Publishing
	for i := range 10 {
		more = append(more, ok(fmt.Sprintf("evt_n%d", i), "5"))
	}
	e.publishRaw(more...)
	s := until("everything settled", func(s scrape) bool {
		return processed(s) == n+10 && s.value("idem_deliveries_total", "outcome", "duplicate_postgres") == float64(dups) &&
			s.value("idem_deliveries_in_flight") == 0 && s.value("idem_prefetch_in_use") == 0
	})

	t.Logf("the breaker opened after %d copies reached Postgres", dups)
	deliveries := float64(n + n + 2 + dups + 10)
	want := []struct {
		name   string
		labels []string
		value  float64
	}{
		{"idem_deliveries_total", []string{"outcome", "processed", "reason", ""}, n + 10},
		{"idem_deliveries_total", []string{"outcome", "duplicate_redis"}, n},
		{"idem_deliveries_total", []string{"outcome", "duplicate_postgres"}, float64(dups)},
		{"idem_deliveries_total", []string{"outcome", "duplicate_batch"}, 0},
		{"idem_deliveries_total", []string{"outcome", "payload_conflict", "reason", "payload_conflict"}, 1},
		{"idem_deliveries_total", []string{"outcome", "dead_lettered", "reason", "invalid_json"}, 1},
		{"idem_deliveries_total", []string{"outcome", "dead_lettered"}, 1},
		{"idem_deliveries_total", []string{"outcome", "retry"}, 0},
		{"idem_deliveries_total", nil, deliveries},
		{"idem_dead_letters_total", []string{"reason", "payload_conflict"}, 1},
		{"idem_dead_letters_total", []string{"reason", "invalid_json"}, 1},
		// Every acked delivery has an age; dead letters do not.
		{"idem_event_age_seconds", nil, deliveries - 2},
		{"idem_batch_size", nil, -1}, // checked below: its sum is the deliveries
		{"idem_breaker_state", []string{"state", "open"}, 1},
		{"idem_breaker_state", []string{"state", "closed"}, 0},
		{"idem_breaker_state", []string{"state", "half-open"}, 0},
		{"idem_breaker_open", nil, 1},
		{"idem_breaker_transitions_total", []string{"from", "closed", "to", "open"}, 1},
		{"idem_deliveries_in_flight", nil, 0},
		{"idem_prefetch_in_use", nil, 0},
		{"idem_prefetch_limit", nil, 32},
		{"idem_consuming", nil, 1},
		{"idem_store_retries_in_place_total", nil, 0},
		{"idem_reconnects_total", nil, 0},
		{"idem_broker_refusals_total", nil, 0},
		{"idem_dead_letters_returned_total", nil, 0},
		{"idem_batch_splits_total", nil, 0},
		{"idem_untimed_accepted_total", nil, 0},
		{"idem_retention_rows_pruned_total", nil, 0},
		{"idem_postgres_errors_total", nil, 0},
		{"idem_postgres_standbys", []string{"shard", "0"}, 0}, // the shared server has none
		{"idem_postgres_sync_standbys", []string{"shard", "0"}, 0},
		{"idem_redis_errors_total", []string{"op", "fast_claim", "kind", "server"}, 0},
		{"idem_build_info", nil, 1},
		{"idem_outbox_attempts_total", []string{"destination", "receipts", "result", "sent"}, 0},
		{"idem_outbox_pending_rows", nil, 0},
		{"idem_outbox_dead_rows", nil, 0},
		{"idem_outbox_broker_refusals_total", nil, 0},
	}
	for _, w := range want {
		if w.value < 0 {
			continue
		}
		require.Equal(t, w.value, s.value(w.name, w.labels...), "%s%v", w.name, w.labels)
	}
	require.Equal(t, deliveries, s.histogramSum("idem_batch_size"), "batches hold every delivery once")
	// Redis was asked while it was dying (connection or timeout): the
	// breaker's five consecutive failures, by claims and by the marker
	// writer alike; and then not at all (breaker_open), for the 10 new
	// events at least.
	require.GreaterOrEqual(t, s.value("idem_redis_errors_total", "kind", "connection")+
		s.value("idem_redis_errors_total", "kind", "timeout"), 5.0)
	require.Positive(t, s.value("idem_redis_errors_total", "op", "fast_claim", "kind", "breaker_open"))
	for _, stage := range []string{"fast_claim", "store_claim", "apply", "commit", "mark_done"} {
		require.Positive(t, s.value("idem_stage_duration_seconds", "stage", stage), stage)
	}
	// 4 transactions at least (the first events, the conflict, the Redis
	// outage, the new events); an apply per batch with new events, and a
	// commit for each of those and for each batch whose rows the claim
	// only found (it commits so that a synchronous standby has them).
	require.GreaterOrEqual(t, s.value("idem_stage_duration_seconds", "stage", "store_claim"), 4.0)
	require.GreaterOrEqual(t, s.value("idem_stage_duration_seconds", "stage", "commit"), s.value("idem_stage_duration_seconds", "stage", "apply"))
	require.Positive(t, s.value("go_goroutines"))
	require.Positive(t, s.value("process_resident_memory_bytes"))

	// Redis down keeps the instance ready; it is only reported.
	code, text := get(t, "http://"+addr+"/readyz")
	require.Equal(t, http.StatusOK, code, text)
	require.Contains(t, text, "redis: failing (not required)")
	require.Contains(t, text, "relay: ok")
	require.Contains(t, text, "outbox: ok: 0 pending")
	require.Contains(t, text, "replication: ok: no standby")
	code, _ = get(t, "http://"+addr+"/healthz")
	require.Equal(t, http.StatusOK, code)

	// Every metric the dashboard queries exists.
	for _, name := range dashboardMetrics(t) {
		require.Contains(t, s, name, "the dashboard queries %s, which /metrics does not have", name)
	}
	e.stopAll()
}

// dashboardMetrics lists the metric families the Grafana dashboard's
// queries name (a histogram's _bucket, _sum and _count name its family).
func dashboardMetrics(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("../../deploy/grafana/dashboards/idem.json")
	require.NoError(t, err)
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	require.NoError(t, json.Unmarshal(b, &dash))
	metric := regexp.MustCompile(`\b(?:idem|go|process)_[a-z_]+`)
	var out []string
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			names := metric.FindAllString(tg.Expr, -1)
			require.NotEmpty(t, names, "panel %q queries no idem metric: %s", p.Title, tg.Expr)
			for _, name := range names {
				for _, suffix := range []string{"_bucket", "_sum", "_count"} {
					name = strings.TrimSuffix(name, suffix)
				}
				if !slices.Contains(out, name) {
					out = append(out, name)
				}
			}
		}
	}
	require.NotEmpty(t, out)
	return out
}

// TestReadyzFollowsPostgres stops a test-owned PostgreSQL under a consumer:
// /readyz turns unready, /healthz stays up, and both are ready again once
// Postgres returns.
func TestReadyzFollowsPostgres(t *testing.T) {
	t.Parallel()
	testenv.Shared(t) // before its Postgres starts, not only in newEnv
	pg := testenv.StartPostgres(t)
	e := newEnvOn(t, "", "", pg.URL())
	addr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	e.consume("c0", "IDEM_METRICS_ADDR="+addr)
	readyz := func(want int) string {
		t.Helper()
		var text string
		require.Eventually(t, func() bool {
			var code int
			code, text = get(t, "http://"+addr+"/readyz")
			return code == want
		}, 60*time.Second, 20*time.Millisecond, "/readyz never answered %d: %s", want, text)
		return text
	}
	readyz(http.StatusOK)
	pg.Stop()
	text := readyz(http.StatusServiceUnavailable)
	require.Contains(t, text, "postgres: failing")
	require.Contains(t, text, "consumer: ok", "the consumer itself still consumes")
	code, _ := get(t, "http://"+addr+"/healthz")
	require.Equal(t, http.StatusOK, code, "the process is alive: liveness must not follow Postgres")
	pg.Start()
	readyz(http.StatusOK)
	e.stopAll()
}

// TestConsumersPruneOnInterval: with postgres.prune_interval set, a consumer
// deletes dedup rows past retention + clock skew, counts them, and keeps
// the others.
func TestConsumersPruneOnInterval(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	_, err := e.pool.Exec(context.Background(), `INSERT INTO idem_processed (scope, event_id, payload_hash, processed_at)
		SELECT 'payments', 'evt_old_' || i, '\x00'::bytea, now() - interval '2 hours' FROM generate_series(1, 5) i
		UNION ALL SELECT 'payments', 'evt_recent', '\x00'::bytea, now() - interval '10 minutes'`)
	require.NoError(t, err)
	addr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	e.consume("c0", "IDEM_METRICS_ADDR="+addr, "IDEM_POSTGRES_PRUNE_INTERVAL=1s", "IDEM_POSTGRES_RETENTION=1h",
		"IDEM_REDIS_DONE_TTL=30m", "IDEM_CONSUMER_CLOCK_SKEW=5m")
	require.Eventually(t, func() bool {
		s, err := tryScrape(addr)
		return err == nil && s.value("idem_retention_rows_pruned_total") == 5
	}, 60*time.Second, 50*time.Millisecond)
	var left []string
	rows, err := e.pool.Query(context.Background(), `SELECT event_id FROM idem_processed`)
	require.NoError(t, err)
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		left = append(left, id)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"evt_recent"}, left, "only rows past retention + skew go")
	e.stopAll()
}
