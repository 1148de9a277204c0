package relay

import (
	"context"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5/pgxpool"
)

// PerShard returns one relay per database of dbs, each c on its database;
// with several, each one's connection name and logs name its shard. They
// share c.Metrics.
func PerShard(c Config, dbs []*pgxpool.Pool) ([]*Relay, error) {
	c = c.WithDefaults()
	var rs []*Relay
	for i, db := range dbs {
		sc := c
		sc.DB = db
		if len(dbs) > 1 {
			sc.Logger = c.Logger.With("shard", i)
			if sc.Name != "" {
				sc.Name = fmt.Sprintf("%s-shard%d", c.Name, i)
			}
		}
		r, err := New(sc)
		if err != nil {
			return nil, err
		}
		rs = append(rs, r)
	}
	return rs, nil
}

// RunAll runs rs until ctx ends, and returns once each has returned.
func RunAll(ctx context.Context, rs []*Relay) {
	var wg sync.WaitGroup
	for _, r := range rs {
		wg.Go(func() { _ = r.Run(ctx) }) // nil once ctx ends
	}
	wg.Wait()
}
