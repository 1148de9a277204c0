package guard

import "context"

// Abandon ends b without deciding it, for a caller that hands its events
// back to the queue instead: it releases the leases Screen took, so that the
// events find no lease of the caller's when they come back. Nothing of b
// reaches the store. Call it instead of Decide, not after.
func (g *Guard) Abandon(ctx context.Context, b *Batch) {
	g.release(ctx, leaseList(b.leases))
}
