package payments_test

import (
	"context"
	"io/fs"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/payments"
	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/migrations"
)

// TestMigrateUpgradesTheEarlierLayout: before the reference handler's tables
// had their own set, idem_migrations recorded them as version 2. Such a
// database must take the new guard migration and the payments set without
// error or loss.
func TestMigrateUpgradesTheEarlierLayout(t *testing.T) {
	t.Parallel()
	pool, _ := testenv.EmptySchema(t)
	ctx := context.Background()
	guard, err := migrations.All()
	require.NoError(t, err)
	own, err := fs.ReadFile(payments.Migrations.Files, "0001_payments.sql")
	require.NoError(t, err)
	_, err = pool.Exec(ctx, guard[0].SQL)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, string(own))
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `CREATE TABLE idem_migrations (version int PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now());
		INSERT INTO idem_migrations (version, name) VALUES (1, 'idem_processed'), (2, 'payments');
		INSERT INTO account_balances (user_id, balance) VALUES ('u', 42);`)
	require.NoError(t, err)

	ran, err := payments.Migrate(ctx, pool)
	require.NoError(t, err)
	var names []string
	for _, m := range ran {
		names = append(names, m.Name)
	}
	require.Equal(t, []string{"idem_horizon", "idem_processed_brin", "idem_shard", "idem_horizon_untimed", "idem_stream", "idem_outbox", "idem_outbox_event_at", "idem_outbox_pause", "idem_instance", "payments", "receipts"}, names)
	var balance int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT balance FROM account_balances WHERE user_id = 'u'`).Scan(&balance))
	require.Equal(t, int64(42), balance)
}
