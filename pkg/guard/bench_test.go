package guard_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
	"github.com/idemhq/idem/pkg/guard/redistier"
)

// BenchmarkProcess measures one event through the guard on the real local
// Postgres and Redis: new events and duplicates, with the two tiers and with
// the Postgres-only baseline side by side in the same run.
//
//	go test -run '^$' -bench Process -count 5 ./pkg/guard/ | benchstat -
func BenchmarkProcess(b *testing.B) {
	pool, _ := testenv.Schema(b, testenv.Effects)
	rdb, prefix := testenv.Redis(b)
	fast, err := redistier.New(rdb, redistier.Config{Prefix: prefix})
	require.NoError(b, err)
	tiers := []struct {
		name, tag string
		fast      guard.FastPath
	}{{"postgres-only", "pg", nil}, {"redis+postgres", "two", fast}}
	for _, tier := range tiers {
		g, err := guard.New(guard.Config{Scope: "bench", Store: pgtier.New(pool), Fast: tier.fast})
		require.NoError(b, err)
		run := testenv.Name(b)
		n := 0 // survives -count reruns, so every "new" event is new
		b.Run("new/"+tier.name, func(b *testing.B) {
			for b.Loop() {
				n++
				id := fmt.Sprintf("evt_%s_%s_%d", run, tier.tag, n)
				if _, err := g.Process(context.Background(), event(id, 1), pay(id)); err != nil {
					b.Fatal(err)
				}
			}
		})
		dup := fmt.Sprintf("evt_%s_%s_dup", run, tier.tag)
		_, err = g.Process(context.Background(), event(dup, 1), pay(dup))
		require.NoError(b, err)
		b.Run("duplicate/"+tier.name, func(b *testing.B) {
			for b.Loop() {
				o, err := g.Process(context.Background(), event(dup, 1), pay(dup))
				if err != nil || !o.IsDuplicate() {
					b.Fatal(o, err)
				}
			}
		})
	}
}
