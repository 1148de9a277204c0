package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/relay"
	"github.com/idemhq/idem/internal/testenv"
)

// TestResendWaitsForAPassUnderWay: a relay pass published a row (into a
// queue about to be deleted, say) and has not marked it sent when the
// operator resends the destination's rows. Resend read the row as pending,
// skipped it, and the pass then marked it sent: its message was lost. Resend
// now locks every lane first, so it waits for the pass, and re-pends the
// row it marked.
func TestResendWaitsForAPassUnderWay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := testenv.Schema(t)
	var id int64
	require.NoError(t, pool.QueryRow(ctx, `INSERT INTO idem_outbox (scope, event_id, idx, destination, lane, body)
		VALUES ('pay', 'e1', 0, 'audit', 3, '') RETURNING id`).Scan(&id))

	pass, err := pool.Begin(ctx) // as a pass: its lane, then its row
	require.NoError(t, err)
	defer pass.Rollback(ctx)
	_, err = pass.Exec(ctx, `SELECT lane FROM idem_outbox_lane WHERE lane = 3 FOR UPDATE SKIP LOCKED`)
	require.NoError(t, err)
	_, err = pass.Exec(ctx, `SELECT id FROM idem_outbox WHERE id = $1 FOR UPDATE SKIP LOCKED`, id)
	require.NoError(t, err)

	done := make(chan int64, 1)
	go func() {
		n, err := relay.Resend(ctx, pool, relay.Filter{Destination: "audit"}, relay.Since{Back: time.Hour}, false)
		require.NoError(t, err)
		done <- n
	}()
	select {
	case n := <-done:
		t.Fatalf("resend went on while a pass held its lane: %d row(s)", n)
	case <-time.After(500 * time.Millisecond):
	}
	_, err = pass.Exec(ctx, `UPDATE idem_outbox SET state = 'sent', sent_at = clock_timestamp(), attempts = attempts + 1 WHERE id = $1`, id)
	require.NoError(t, err)
	require.NoError(t, pass.Commit(ctx))
	require.Equal(t, int64(1), <-done, "the row the pass marked sent is resent")
	var state string
	require.NoError(t, pool.QueryRow(ctx, `SELECT state FROM idem_outbox WHERE id = $1`, id).Scan(&state))
	require.Equal(t, "pending", state)
}
