// Command idem runs and checks an effectively-once RabbitMQ consumer fleet.
// See 'idem --help'.
package main

import "github.com/idemhq/idem/internal/cli"

func main() { cli.Main("idem", cli.Run) }
