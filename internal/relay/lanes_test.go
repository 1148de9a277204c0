package relay_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/outbox"
)

// TestALaneAnotherHoldsIsLeftAlone: a pass locks no row, only lanes; it
// reads no row of a lane another transaction holds (another relay's pass,
// or Resend), and publishes that lane's rows once it is free.
func TestALaneAnotherHoldsIsLeftAlone(t *testing.T) {
	db, _ := testenv.Schema(t)
	top := declare(t, testenv.Queue(t, testenv.AMQPURL()), 1)
	g := newGuard(t, db)
	ctx := context.Background()
	const lane, held = 5, 3
	keys := keysOfLane(lane, held) // the held lane's rows, then one in each other lane
	for l := range relay.Lanes {
		if l != lane {
			keys = append(keys, keysOfLane(l, 1)...)
		}
	}
	n := len(keys)
	for i, k := range keys {
		id := fmt.Sprintf("e%02d", i)
		send(t, g, id, outbox.Message{EventID: id, To: "q", Key: k, Body: []byte(id)})
	}
	tx, err := db.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `SELECT lane FROM idem_outbox_lane WHERE lane = $1 FOR UPDATE`, lane)
	require.NoError(t, err)

	run(t, relay.Config{DB: db, AMQPURLs: []string{testenv.AMQPURL()}, LanesPerPass: relay.Lanes, BatchSize: 7,
		Destinations: amqpDest(t, "q=queue:"+top.Queue)})
	got := take(t, n-held, top.Queue)
	require.Len(t, got, n-held, "every row but the held lane's")
	require.Eventually(t, func() bool { return states(t, db)["pending"] == held }, 10*time.Second, 20*time.Millisecond)
	var pending int
	require.NoError(t, db.QueryRow(ctx, `SELECT count(*) FROM idem_outbox WHERE state = 'pending' AND lane <> $1`, lane).Scan(&pending))
	require.Zero(t, pending)

	require.NoError(t, tx.Rollback(ctx))
	got = take(t, held, top.Queue)
	require.Len(t, got, held, "the lane's rows, once it is free")
}

// TestRelaysSharingLanesPublishEachRowOnce: relays with small passes
// contend for the lanes, each taking one after another's commit. With no
// failure, every row is published exactly once: a pass reads its lanes'
// rows in a statement whose snapshot is taken once it holds them, so it
// sees what their last holder marked; and so on a database whose default
// isolation is REPEATABLE READ too, where a transaction's first statement
// would take the snapshot.
func TestRelaysSharingLanesPublishEachRowOnce(t *testing.T) {
	for _, iso := range []string{"read committed", "repeatable read"} {
		t.Run(strings.ReplaceAll(iso, " ", "-"), func(t *testing.T) {
			db, u := testenv.Schema(t)
			pool := tunedPool(t, u, func(pc *pgxpool.Config) { pc.ConnConfig.RuntimeParams["default_transaction_isolation"] = iso })
			top := declare(t, testenv.Queue(t, testenv.AMQPURL()), 1)
			g := newGuard(t, db)
			const n = 1500
			for i := range n / 10 {
				id := fmt.Sprintf("e%03d", i)
				var msgs []outbox.Message
				for j := range 10 {
					msgs = append(msgs, outbox.Message{EventID: id, Index: j, To: "q", Key: fmt.Sprintf("u%d", (i*10+j)%40), Body: []byte(fmt.Sprintf("%d/%d", i, j))})
				}
				send(t, g, id, msgs...)
			}
			for k := range 4 {
				run(t, relay.Config{DB: pool, AMQPURLs: []string{testenv.AMQPURL()}, BatchSize: 3, LanesPerPass: 1 + k%3,
					Destinations: amqpDest(t, "q=queue:"+top.Queue)})
			}
			got := take(t, n, top.Queue)
			seen := map[string]int{}
			for _, d := range got {
				seen[d.MessageId]++
			}
			for id, k := range seen {
				require.Equal(t, 1, k, "message %s", id)
			}
			require.Len(t, seen, n)
		})
	}
}
