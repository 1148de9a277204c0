package roundtrip

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
)

func TestClassify(t *testing.T) {
	for _, c := range []struct {
		sql  string
		want Cause
	}{
		// The guard's (pkg/guard/pgtier), as they open.
		{`BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL synchronous_commit = on; SET LOCAL plan_cache_mode = force_generic_plan; SELECT pg_advisory_xact_lock_shared(1)`, CauseBegin},
		{`WITH hist AS (SELECT left(md5(concat_ws('/', (SELECT system_identifier FROM pg_control_system()))), 12) AS history), c AS (INSERT INTO idem_processed`, CauseClaim},
		{`SELECT left(md5(concat_ws('/', (SELECT system_identifier FROM pg_control_system()), pg_relation_filenode(to_regclass('idem_processed')))), 12)`, CauseHistory},
		{`SELECT pg_logical_emit_message(true, 'idem', '')`, CauseWALMessage},
		{"SELECT u.id, (SELECT p.payload_hash FROM idem_processed p WHERE p.scope = $1 AND p.event_id = u.id)\nFROM unnest($2::text[]) AS u(id)", CauseLookup},
		{`UPDATE idem_horizon SET untimed_claimed_at = now() WHERE untimed_claimed_at IS NULL`, CauseOther},
		// pgx's.
		{"begin", CauseBegin},
		{"commit", CauseCommit},
		{"rollback", CauseRollback},
		// The handlers' (internal/payments).
		{"INSERT INTO payments_ledger (event_id, user_id, amount)\nSELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])", CauseApply},
		{"\n\tINSERT INTO account_balances (user_id, balance) VALUES ($1, $2)", CauseApply},
		{`INSERT INTO receipts (event_id, payment_id, user_id, amount) SELECT * FROM unnest($1::text[])`, CauseApply},
		// A connection's set-up (internal/pgsession) and session settings.
		{`SELECT count(set_config(s.name, b.value, false)) FROM unnest($1::text[], $2::text[]) AS b(name, value)`, CauseSession},
		{"SET search_path = s1", CauseSession},
		{"show server_version", CauseSession},
		{"RESET search_path", CauseSession},
		{"SELECT 1", CauseOther},
		{"", CauseOther},
	} {
		require.Equal(t, c.want, Classify(c.sql), c.sql)
	}
}

func TestByCauseCountsTripsAndTime(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg, err := pgx.ParseConfig(testenv.DatabaseURL())
	require.NoError(t, err)
	var b ByCause
	cfg.Tracer = b.Tracer()
	conn, err := pgx.ConnectConfig(ctx, cfg)
	require.NoError(t, err)
	defer conn.Close(context.WithoutCancel(ctx))

	tx, err := conn.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, "SELECT pg_sleep(0.02)")
	require.NoError(t, err)
	batch := &pgx.Batch{}
	batch.Queue("SET LOCAL search_path = public")
	batch.Queue("SELECT 1")
	require.NoError(t, tx.SendBatch(ctx, batch).Close())
	require.NoError(t, tx.Commit(ctx))

	got := b.Snapshot()
	require.Equal(t, int64(4), b.Total(), "%v", got)
	require.Equal(t, int64(1), got[CauseBegin].Trips)
	require.Equal(t, int64(1), got[CauseCommit].Trips)
	require.Equal(t, int64(1), got[CauseSession].Trips, "a batch is one trip, classified by its first statement")
	require.Equal(t, int64(1), got[CauseOther].Trips)
	require.GreaterOrEqual(t, got[CauseOther].WaitMicros, int64(20_000), "pg_sleep's 20ms is waited for")
}
