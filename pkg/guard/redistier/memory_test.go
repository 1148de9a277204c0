package redistier_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/redistier"
)

// BenchmarkDoneMarkerMemory measures what one done marker costs in Redis:
// it writes b.N markers for realistic event IDs and payload hashes into a
// redis-server of its own and reports used_memory growth per key (B/key).
// Redis memory for a dedup window is this times the events in the window:
//
//	go test -run '^$' -bench DoneMarkerMemory -benchtime 200000x ./pkg/guard/redistier/
func BenchmarkDoneMarkerMemory(b *testing.B) {
	rs := testenv.StartRedis(b)
	rdb := rs.Client()
	defer rdb.Close()
	ctx := context.Background()
	f, err := redistier.New(rdb, redistier.Config{})
	if err != nil {
		b.Fatal(err)
	}
	before := usedMemory(b, rdb)
	b.ResetTimer()
	const batch = 500
	events := make([]guard.Event, 0, batch)
	for i := range b.N {
		id := fmt.Sprintf("evt_%012d", i)
		events = append(events, guard.Event{ID: id, Hash: guard.HashFields(id, "user_42", "PAYMENT_COMPLETED", "1000")})
		if len(events) == batch || i == b.N-1 {
			if err := f.MarkDone(ctx, "payments", "f3647a897925", events); err != nil { // a history as pgtier names one
				b.Fatal(err)
			}
			events = events[:0]
		}
	}
	b.StopTimer()
	n, err := rdb.DBSize(ctx).Result()
	if err != nil || n != int64(b.N) {
		b.Fatalf("want %d keys, have %d (%v)", b.N, n, err)
	}
	b.ReportMetric(float64(usedMemory(b, rdb)-before)/float64(b.N), "B/key")
}

func usedMemory(b *testing.B, rdb *redis.Client) int64 {
	info, err := rdb.Info(context.Background(), "memory").Result()
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "used_memory:"); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				b.Fatal(err)
			}
			return n
		}
	}
	b.Fatal("no used_memory in INFO memory")
	return 0
}
