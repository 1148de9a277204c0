// Command idem-lab is idem's proving ground: the demo, the chaos run, the
// lab of approaches and the bench, with the operator's commands beside
// them and a consume that crash points can arm. See 'idem-lab --help'. The
// shipped binary is cmd/idem.
package main

import (
	"github.com/idemhq/idem/internal/cli"
	"github.com/idemhq/idem/internal/harness"
)

func main() { cli.Main("idem-lab", harness.Run) }
