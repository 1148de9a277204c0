// Package chaos holds the end-to-end runs that load the machine most: the
// CI scenarios of `idem-lab chaos` (each run starts its own Redis and
// PostgreSQL, and with --cluster its own RabbitMQ and Redis clusters),
// TestFleetOnClusters and `idem-lab lab`. They were test/e2e's; in a
// package of their own they run one at a time, while go test runs test/e2e
// beside them rather than after them.
package chaos

import (
	"testing"

	"github.com/idemhq/idem/internal/testenv"
)

// idemBin is the shipped binary (cmd/idem); labBin is the harness
// (cmd/idem-lab), whose chaos command runs the fleet.
var idemBin, labBin string

func TestMain(m *testing.M) { testenv.MainWithBinaries(m, raceEnabled, &idemBin, &labBin) }
