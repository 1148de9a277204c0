package guard

import "context"

// Ping reports whether every shard's store answers: it begins a
// transaction on each and rolls it back. A consumer that handed its
// deliveries back because its store stayed away pings before it takes
// deliveries again.
func (g *Guard) Ping(ctx context.Context) error {
	for i, s := range g.stores {
		tx, err := s.Begin(ctx)
		if err != nil {
			shard := i
			if len(g.stores) == 1 {
				shard = -1
			}
			return &StoreError{Op: StoreBegin, Err: err, Shard: shard}
		}
		_ = tx.Rollback(ctx)
	}
	return nil
}
