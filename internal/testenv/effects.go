package testenv

import (
	"embed"

	"github.com/idemhq/idem/migrations"
)

//go:embed effects/*.sql
var effectFiles embed.FS

// Effects is a test handler's tables, ledger(event_id, user_id, amount)
// and balances(user_id, balance), for Schema: the library's tests apply
// effects of their own rather than the reference payments handler's.
var Effects = migrations.SetIn("testenv_migrations", effectFiles, "effects")
