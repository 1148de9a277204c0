package metrics_test

import (
	"context"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
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
	m.Settled(context.Background(), consumer.Settlement{Outcome: guard.OutcomePayloadConflict, Reason: consumer.ReasonPayloadConflict})

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
