package pgtier_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/pgtier"
)

// BenchmarkProcessedRowSize measures what one dedup row costs in Postgres,
// indexes included: it claims b.N events with realistic IDs in a schema of
// its own and reports the table's total size per row (B/row). The table
// for a retention window is this times the events in the window:
//
//	go test -run '^$' -bench ProcessedRowSize -benchtime 200000x ./pkg/guard/pgtier/
func BenchmarkProcessedRowSize(b *testing.B) {
	pool, _ := testenv.Schema(b, testenv.Effects)
	ctx := context.Background()
	s := pgtier.New(pool)
	const batch = 1000
	events := make([]guard.Event, 0, batch)
	flush := func() {
		tx, err := s.Begin(ctx)
		if err != nil {
			b.Fatal(err)
		}
		if _, _, err := s.Claim(ctx, tx, "payments", events); err != nil {
			b.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			b.Fatal(err)
		}
		events = events[:0]
	}
	for i := range b.N {
		id := fmt.Sprintf("evt_%012d", i)
		events = append(events, guard.Event{ID: id, Hash: guard.HashFields(id, "user_42", "PAYMENT_COMPLETED", "1000")})
		if len(events) == batch {
			flush()
		}
	}
	if len(events) > 0 {
		flush()
	}
	b.StopTimer()
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE idem_processed"); err != nil {
		b.Fatal(err)
	}
	var rows, size int64
	if err := pool.QueryRow(ctx, `SELECT count(*), pg_total_relation_size('idem_processed') FROM idem_processed`).Scan(&rows, &size); err != nil {
		b.Fatal(err)
	}
	if rows != int64(b.N) {
		b.Fatalf("want %d rows, have %d", b.N, rows)
	}
	b.ReportMetric(float64(size)/float64(rows), "B/row")
}
