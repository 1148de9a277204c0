// Command idem-lab is idem's proving ground: the demo, the chaos run, the
// lab of approaches and the bench, with the operator's commands beside
// them and a consume that crash points can arm. See 'idem-lab --help'. The
// shipped binary is cmd/idem.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/idemhq/idem/internal/cli"
	"github.com/idemhq/idem/internal/harness"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := harness.Run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	switch {
	case err == nil, cli.IsHelp(err):
	case errors.Is(err, cli.ErrUsage):
		os.Exit(2)
	default:
		if !errors.Is(err, cli.ErrVerifyFailed) && !cli.Reported(err) {
			fmt.Fprintln(os.Stderr, "idem-lab:", err)
		}
		os.Exit(1)
	}
}
