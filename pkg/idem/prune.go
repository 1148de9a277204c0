package idem

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/internal/horizon"
)

// pruneBatch is the rows each of pruneEvery's DELETEs removes.
const pruneBatch = 10000

// pruneEvery deletes rows beyond the retention every interval until ctx
// ends. Every instance of a fleet may run it: prunes serialise on
// idem_horizon and delete disjoint rows.
func (s *Service[T]) pruneEvery(ctx context.Context, every time.Duration, db *pgxpool.Pool, log *slog.Logger) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n, cutoff, err := horizon.Prune(ctx, db, horizon.PruneConfig{
			Retention: s.cfg.Consumer.Retention, ClockSkew: s.cfg.Consumer.ClockSkew, Batch: pruneBatch})
		if s.metrics != nil {
			s.metrics.Pruned(n)
		}
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			log.Error("prune", "err", err, "rows", n)
		default:
			log.Info("pruned", "rows", n, "processed_before", cutoff.UTC().Format(time.RFC3339))
		}
	}
}
