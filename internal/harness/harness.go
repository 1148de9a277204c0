// Package harness is idem-lab: the commands that prove idem rather than run
// it (demo, chaos, lab, bench and their worker processes), beside the
// operator's commands. Its consume can be armed to SIGKILL itself at a step
// of the flow (IDEM_CRASH_AT, see package crashpoint); the shipped idem
// binary links none of this, so nothing in it can kill itself or start a
// server.
package harness

import (
	"context"
	"io"

	"github.com/idemhq/idem/internal/cli"
	"github.com/idemhq/idem/internal/crashpoint"
)

// Run runs the idem-lab command with args (without the program name).
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return cli.RunWith(ctx, "idem-lab", Commands(), args, stdout, stderr)
}

// Commands are idem-lab's: the harness's, then the operator's, with a
// consume that crash points can arm.
func Commands() []cli.Command {
	cmds := []cli.Command{
		{Name: "demo", Summary: "run a fleet on a stream with duplicates and verify it", Run: runDemo},
		{Name: "chaos", Summary: "run a fleet under a seeded schedule of faults and judge it", Run: runChaos},
		{Name: "lab", Summary: "compare the five dedup approaches under the same faults", Run: runLab},
		{Name: "lab-worker", Summary: "one worker process of 'idem-lab lab' (started by it)", Run: runLabWorker},
		{Name: "bench", Summary: "measure throughput, CPU and latency against a raw consumer", Run: runBench},
		{Name: "bench-worker", Summary: "one consumer process of 'idem-lab bench' (started by it)", Run: runBenchWorker},
	}
	for _, c := range cli.Commands() {
		if c.Name == "consume" || c.Name == "relay" {
			c.Summary += "; IDEM_CRASH_AT arms a SIGKILL at a step"
			c.Run = armed(c.Run)
		}
		cmds = append(cmds, c)
	}
	return cmds
}

// armed is run with the crash points of the environment armed.
func armed(run func(context.Context, *cli.Env, []string) error) func(context.Context, *cli.Env, []string) error {
	return func(ctx context.Context, e *cli.Env, args []string) error {
		if err := crashpoint.Install(e.Getenv); err != nil {
			return err
		}
		return run(ctx, e, args)
	}
}
