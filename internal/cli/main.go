package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

// Main runs a command line program: run with the arguments and a context
// that SIGINT and SIGTERM cancel; exit 2 on a usage error, 1 on any other
// (printed as "prog: err" unless it was reported already), 0 otherwise.
func Main(prog string, run func(ctx context.Context, args []string, stdout, stderr io.Writer) error) {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	switch {
	case err == nil, IsHelp(err):
	case errors.Is(err, ErrUsage):
		os.Exit(2)
	default:
		if !errors.Is(err, ErrVerifyFailed) && !Reported(err) {
			fmt.Fprintln(os.Stderr, prog+":", err)
		}
		os.Exit(1)
	}
}
