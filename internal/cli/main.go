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
// that SIGINT and SIGTERM cancel; exit 2 on a usage error or a setting no
// retry fixes (configErr), 1 on any other (printed as "prog: err" unless it
// was reported already), 0 otherwise.
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
		var bad *configError
		if errors.As(err, &bad) {
			os.Exit(2)
		}
		os.Exit(1)
	}
}

// configErr marks err as a setting that no retry fixes (RabbitMQ refusing
// amqp_url's credentials or vhost, again and again, at start): Main prints
// it and exits 2, as for a usage error.
func configErr(err error) error { return &configError{err} }

type configError struct{ error }

func (e *configError) Unwrap() error { return e.error }
