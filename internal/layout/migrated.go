package layout

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemhq/idem/migrations"
)

// UnmigratedError is what CheckMigrated returns for a migration set whose
// ledger lacks some of its migrations. Its message says what is missing;
// the caller adds the remedy its user has (`idem migrate`, Migrate in
// idem.Config, idem consume without --no-migrate).
type UnmigratedError struct {
	// Ledger is the set's ledger table: migrations.Guard's for idem's own.
	Ledger string
	// Missing are the set's migrations the ledger does not record, in
	// version order.
	Missing []migrations.Migration
}

// Own reports whether the set is idem's own (migrations.Guard), not a
// service's.
func (e *UnmigratedError) Own() bool { return e.Ledger == migrations.Guard.Ledger }

func (e *UnmigratedError) Error() string {
	m := e.Missing[0]
	missing := fmt.Sprintf("%04d_%s", m.Version, m.Name)
	if n := len(e.Missing) - 1; n > 0 {
		missing += fmt.Sprintf(" and %d more", n)
	}
	if e.Own() {
		return fmt.Sprintf("idem's tables are missing in this database (in the first schema of its search_path; not applied: %s)", missing)
	}
	return fmt.Sprintf("the service's migrations (set %s) are not applied in this database (in the first schema of its search_path; not applied: %s)", e.Ledger, missing)
}

// CheckMigrated returns an *UnmigratedError for the first of sets whose
// ledger in db lacks one of its migrations, or nil if every set is
// applied. A process that does not migrate at start calls it first, so
// that forgotten migrations are reported as such rather than as a missing
// table in whatever check comes next. It writes nothing.
func CheckMigrated(ctx context.Context, db *pgxpool.Pool, sets ...migrations.Set) error {
	for _, set := range sets {
		missing, err := migrations.Pending(ctx, db, set)
		if err != nil {
			return fmt.Errorf("check migrations: %w", err)
		}
		if len(missing) > 0 {
			return &UnmigratedError{Ledger: set.Ledger, Missing: missing}
		}
	}
	return nil
}
