package metrics_test

import (
	"context"
	"fmt"
	"net/http"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/redistier"
	"github.com/idemhq/idem/pkg/metrics"
)

// A service registers idem's metrics on its own registry and passes them to
// the guard and the consumer as their Observer.
func Example() {
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	if err != nil {
		panic(err)
	}
	// guard.New(guard.Config{..., Observer: m})
	// consumer.New(consumer.Config{..., Observer: m}, g, handler)
	m.Settled(context.Background(), consumer.Settlement{Outcome: guard.OutcomePayloadConflict, Reason: "payload_conflict"})

	families, _ := reg.Gather()
	for _, f := range families {
		if f.GetName() != "idem_deliveries_total" {
			continue
		}
		for _, s := range f.GetMetric() {
			if v := s.GetCounter().GetValue(); v > 0 {
				fmt.Println(f.GetName(), s.GetLabel()[0].GetValue(), s.GetLabel()[1].GetValue(), v)
			}
		}
	}
	// Output: idem_deliveries_total payload_conflict payload_conflict 1
}

// idHandler is the handler of Example_service.
type idHandler struct{}

func (idHandler) Decode(m consumer.Message) (guard.Event, string, error) {
	return guard.Event{ID: m.ID, Hash: guard.HashFields(string(m.Body)), Time: m.Timestamp}, m.ID, nil
}
func (idHandler) Apply(context.Context, pgx.Tx, string) error { return nil }

// docs/operations.md's "In your own service": the lines between the docs
// markers are quoted there. (Compiled, not run: it needs the services.)
func Example_service() {
	var (
		store   guard.Store
		rdb     *redis.Client
		url     = "amqp://guest:guest@127.0.0.1:5672/"
		handler idHandler
	)
	// docs:begin
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg) // idem_* on your registry
	if err != nil {
		panic(err)
	}
	fast, err := redistier.New(rdb, redistier.Config{Breaker: redistier.BreakerConfig{OnStateChange: m.BreakerChanged}})
	if err != nil {
		panic(err)
	}
	g, err := guard.New(guard.Config{Scope: "billing", Store: store, Fast: fast, Observer: m})
	if err != nil {
		panic(err)
	}
	c, err := consumer.New(consumer.Config{URL: url, Queue: "billing.events", Observer: m}, g, handler)
	if err != nil {
		panic(err)
	}
	if err := m.WatchConsumer(c.Stats); err != nil { // the in-flight, prefetch and blocked gauges
		panic(err)
	}
	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	// docs:end
}
