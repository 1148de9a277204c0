package payments

import (
	"context"
	"embed"

	"github.com/idemhq/idem/migrations"
)

//go:embed migrations/*.sql
var files embed.FS

// Migrations is the reference handler's own set: payments_ledger and
// account_balances, recorded in payments_migrations.
var Migrations = migrations.SetIn("payments_migrations", files, "migrations")

// Migrate applies the guard's migrations, then the reference handler's, and
// returns what it ran.
func Migrate(ctx context.Context, db migrations.Conn) ([]migrations.Migration, error) {
	ran, err := migrations.Apply(ctx, db)
	if err != nil {
		return ran, err
	}
	more, err := migrations.ApplySet(ctx, db, Migrations)
	return append(ran, more...), err
}
