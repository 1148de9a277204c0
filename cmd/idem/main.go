// Command idem runs and checks an effectively-once RabbitMQ consumer fleet.
// See 'idem --help'.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/idemhq/idem/internal/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := cli.Run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	switch {
	case err == nil, cli.IsHelp(err):
	case errors.Is(err, cli.ErrUsage):
		os.Exit(2)
	default:
		if !errors.Is(err, cli.ErrVerifyFailed) && !cli.Reported(err) {
			fmt.Fprintln(os.Stderr, "idem:", err)
		}
		os.Exit(1)
	}
}
