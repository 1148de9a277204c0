package cli

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemhq/idem/internal/loadgen"
	"github.com/idemhq/idem/internal/verify"
)

// ErrVerifyFailed is returned when verification finds doubled, missing or
// mismatched effects. The table says which.
var ErrVerifyFailed = errors.New("verification failed")

func runVerify(ctx context.Context, e *Env, args []string) error {
	fs := NewFlags(e, "verify", "Compares payments_ledger and account_balances (on every shard of\npostgres.shards) with a publish manifest and prints a table. Exits 1 on any\ndoubled, missing, misrouted or mismatched effect.")
	path := fs.String("config", "", "YAML config `file`")
	manifest := fs.String("manifest", "", "manifest `file` written by 'idem publish --manifest' (required)")
	wait := fs.Duration("wait", 0, "keep checking up to this long while events are still missing")
	if err := Parse(fs, args); err != nil {
		return err
	}
	if *manifest == "" {
		fmt.Fprintln(e.Stderr, "idem verify: --manifest is required")
		return ErrUsage
	}
	m, err := loadgen.ReadManifest(*manifest)
	if err != nil {
		return err
	}
	_, _, dbs, err := e.LoadDB(ctx, *path)
	if err != nil {
		return err
	}
	defer dbs.Close()
	r, err := verify.WaitShards(ctx, dbs, m, *wait)
	if err != nil {
		return err
	}
	r.Print(e.Stdout)
	if !r.OK() {
		return ErrVerifyFailed
	}
	return nil
}
