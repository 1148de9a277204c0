// Package cli is the idem command: subcommands, flags and wiring.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"

	"github.com/idemhq/idem/internal/config"
	"github.com/idemhq/idem/internal/redact"
)

// ErrUsage reports bad command-line usage; the message was already printed.
var ErrUsage = errors.New("usage")

// Command is one subcommand.
type Command struct {
	Name    string
	Summary string
	Run     func(ctx context.Context, env *Env, args []string) error
}

// Commands are the operator's: what the shipped idem binary holds.
func Commands() []Command {
	return []Command{
		{"consume", "run one consumer process (run many for a fleet)", RunConsume},
		{"publish", "publish a stream of events with duplicates (load generator)", runPublish},
		{"verify", "check the database against a publish manifest", runVerify},
		{"relay", "publish the outbox: messages handlers sent in their transactions", runRelay},
		{"outbox", "list outbox rows, or replay dead ones (idem outbox -h)", runOutbox},
		{"migrate", "create or update idem's tables (and the reference handlers', with handler set)", runMigrate},
		{"prune", "delete dedup rows older than postgres.retention", runPrune},
		{"repartition", "change the stream's partition count, once its queues are empty", runRepartition},
		{"dlq", "list, show, replay or purge dead letters (idem dlq -h)", runDLQ},
		{"inspect", "show what Redis, the dedup table and the outbox (and the payments ledger, if present) hold for one event", runInspect},
		{"console", "serve the operator's web console: fleet, dead letters, outbox, one event", runConsole},
		{"probe", "ask a consumer's /readyz or /healthz (a container healthcheck)", runProbe},
		{"config", "print every setting with its environment variable and value", runConfig},
		{"version", "print the version and VCS revision of this binary", runVersion},
	}
}

// env is what every subcommand gets from the process.
type Env struct {
	Stdout, Stderr io.Writer // both pass through red
	Getenv         func(string) string
	environ        func() []string
	red            *redact.Redactor
	// jsonLog is the logger of a command whose config asks for JSON logs:
	// Run reports the command's failure through it.
	jsonLog *slog.Logger
	warned  bool   // the config's warnings were logged
	prog    string // the binary's name in usage lines: idem or idem-lab
	// scope and queue are the command's --scope and --queue, if it has
	// them (see targetFlags).
	scope, queue *string
}

// urlVars are the connection settings whose secrets never reach an output.
var urlVars = []string{"AMQP_URL", "REDIS_URL", "DATABASE_URL"}

// Run runs the idem command with args (without the program name). Nothing it
// writes, and no error it returns, holds a password from a connection
// setting (see package redact).
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return RunWith(ctx, "idem", Commands(), args, stdout, stderr)
}

// RunWith is Run for the program prog with the commands cmds.
func RunWith(ctx context.Context, prog string, cmds []Command, args []string, stdout, stderr io.Writer) error {
	red := redact.New()
	for _, k := range urlVars {
		red.Add(os.Getenv(k))
	}
	e := &Env{Stdout: red.Writer(stdout), Stderr: red.Writer(stderr), Getenv: os.Getenv, environ: os.Environ, red: red, prog: prog}
	err := run(ctx, e, cmds, args)
	if err == nil || errors.Is(err, ErrUsage) || IsHelp(err) {
		return err
	}
	err = &redactedError{msg: red.String(err.Error()), err: err}
	if e.jsonLog != nil && !errors.Is(err, ErrVerifyFailed) {
		// In JSON mode the last line is JSON too.
		e.jsonLog.Error(prog+" "+args[0]+" failed", "err", err.Error())
		return &reportedError{err}
	}
	return err
}

// reportedError is an error already logged; the caller need not print it.
type reportedError struct{ error }

func (e *reportedError) Unwrap() error { return e.error }

// Reported reports whether err was already logged (in JSON mode), so that
// the caller must not print it again.
func Reported(err error) bool {
	var r *reportedError
	return errors.As(err, &r)
}

// redactedError is an error whose message was redacted; errors.Is and As
// still see the original chain.
type redactedError struct {
	msg string
	err error
}

func (e *redactedError) Error() string { return e.msg }
func (e *redactedError) Unwrap() error { return e.err }

func run(ctx context.Context, e *Env, cmds []Command, args []string) error {
	stdout, stderr := e.Stdout, e.Stderr
	if len(args) > 0 && (args[0] == "--version" || args[0] == "-version") {
		return runVersion(ctx, e, args[1:])
	}
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(stdout, e.prog, cmds)
		if len(args) == 0 {
			return ErrUsage
		}
		return nil
	}
	for _, c := range cmds {
		if c.Name == args[0] {
			return c.Run(ctx, e, args[1:])
		}
	}
	fmt.Fprintf(stderr, "%s: unknown command %q\n\n", e.prog, args[0])
	usage(stderr, e.prog, cmds)
	return ErrUsage
}

func usage(w io.Writer, prog string, cmds []Command) {
	if prog == "idem" {
		fmt.Fprint(w, `idem makes RabbitMQ event processing effectively once: a Redis fast path in
front of a PostgreSQL unique constraint that commits with the effect.
`)
	} else {
		fmt.Fprintf(w, `%s is idem's proving ground: the demo, the chaos run, the lab and the
bench, with the operator's commands beside them. Its consume can be armed to
SIGKILL itself at a step of the flow (IDEM_CRASH_AT); the shipped idem
binary holds none of this.
`, prog)
	}
	fmt.Fprintf(w, "\nUsage: %s <command> [flags]\n\nCommands:\n", prog)
	for _, c := range cmds {
		fmt.Fprintf(w, "  %-12s %s\n", c.Name, c.Summary)
	}
	fmt.Fprintf(w, `
Connections come from AMQP_URL, REDIS_URL and DATABASE_URL (local services by
default), the queue from IDEM_QUEUE (default payments.events) and the
consuming service's scope from IDEM_SCOPE (default payments); the tools that
read a queue or a scope take --queue and --scope over them. Every other
setting is in the YAML file given by --config or its IDEM_* variable: see
'%[1]s config'. '%[1]s <command> -h' shows a command's flags.
`, prog)
}

// NewFlags returns a flag set whose -h prints a summary and the flags.
func NewFlags(e *Env, name, synopsis string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(e.Stderr)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: %s %s [flags]\n\n%s\n\nFlags:\n", e.prog, name, synopsis)
		fs.PrintDefaults()
	}
	return fs
}

// Parse parses args; -h is not an error.
func Parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return errHelp
		}
		return ErrUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(fs.Output(), "idem %s: unexpected argument %q\n", fs.Name(), fs.Arg(0))
		return ErrUsage
	}
	return nil
}

// UsageErr prints a usage error to stderr and returns ErrUsage (exit 2).
func UsageErr(e *Env, format string, args ...any) error {
	fmt.Fprintf(e.Stderr, format+"\n", args...)
	return ErrUsage
}

// errHelp ends a command after -h without an error exit.
var errHelp = errors.New("help shown")

// IsHelp reports whether err only means that help was shown.
func IsHelp(err error) bool { return errors.Is(err, errHelp) }

// LoadConfig reads the config (with the command's --scope and --queue over
// it), builds the logger it asks for (see newLogger) and logs the config's
// warnings once.
func (e *Env) LoadConfig(path string) (config.Config, *slog.Logger, error) {
	cfg, err := config.Load(path, append(e.environ(), e.targetEnv()...))
	e.red.Add(cfg.AMQPURL, cfg.RedisURL, cfg.DatabaseURL, cfg.Postgres.Shards, // the file may set them too
		cfg.Outbox.Destinations) // an HTTP destination's URL may hold a token
	for _, d := range cfg.RelayConfig().Destinations {
		for _, vs := range d.Header { // outbox.headers' values, read from the environment
			e.red.AddValues(vs...)
		}
	}
	if err != nil {
		if cfg.LogFormat == "json" { // read before the error: report it as JSON
			e.jsonLog = newLogger(e.Stderr, "json", slog.LevelInfo)
		}
		return cfg, nil, err
	}
	level, _ := config.ParseLevel(cfg.LogLevel) // validated by Load
	log := newLogger(e.Stderr, cfg.LogFormat, level)
	if cfg.LogFormat == "json" {
		e.jsonLog = log
	}
	if !e.warned {
		e.warned = true
		for _, w := range cfg.Warnings() {
			log.Warn("config: " + w)
		}
	}
	return cfg, log, nil
}

func runConfig(_ context.Context, e *Env, args []string) error {
	fs := NewFlags(e, "config", "Prints every setting: yaml path, environment variable, effective value.")
	path := fs.String("config", "", "YAML config `file`")
	if err := Parse(fs, args); err != nil {
		return err
	}
	e.warned = true // printed below, with the settings
	cfg, _, err := e.LoadConfig(*path)
	if err != nil {
		return err
	}
	eff := map[string]string{}
	for _, f := range config.FieldsOf(cfg) {
		eff[f.Path] = f.Default
	}
	fmt.Fprintf(e.Stdout, "%-36s %-38s %s\n", "SETTING", "ENV", "VALUE")
	for _, f := range config.Fields() {
		fmt.Fprintf(e.Stdout, "%-36s %-38s %s\n", f.Path, f.Env, eff[f.Path])
	}
	// The warnings idem consume would log with these settings.
	warnings := cfg.Warnings()
	for _, w := range warnings {
		fmt.Fprintf(e.Stdout, "\nwarning: %s", w)
	}
	if len(warnings) > 0 {
		fmt.Fprintln(e.Stdout)
	}
	return nil
}
