package guard

import "context"

// Ping reports whether every shard's store answers: it begins a
// transaction on each and rolls it back. A consumer that handed its
// deliveries back because its store stayed away pings before it takes
// deliveries again.
func (g *Guard) Ping(ctx context.Context) error {
	for i := range g.stores {
		if err := g.PingShard(ctx, i); err != nil {
			return err
		}
	}
	return nil
}

// PingShard is Ping for the store of one shard (Guard.Shard).
func (g *Guard) PingShard(ctx context.Context, shard int) error {
	tx, err := g.stores[shard].Begin(ctx)
	if err != nil {
		return &StoreError{Op: StoreBegin, Err: err, Shard: g.named(shard)}
	}
	_ = tx.Rollback(ctx)
	return nil
}
