package testenv

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/fleet"
)

// Binaries are cmd/idem and cmd/idem-lab built for a package's tests that
// run them as processes (test/e2e, test/chaos).
type Binaries struct {
	Idem, Lab string
	dir       string
}

// BuildBinaries builds cmd/idem and cmd/idem-lab into a temporary
// directory, with -race when race (so that the race detector also watches
// the processes the tests run). For a TestMain: Remove removes them.
func BuildBinaries(race bool) (Binaries, error) {
	dir, err := os.MkdirTemp("", "idem-bin-")
	if err != nil {
		return Binaries{}, err
	}
	b := Binaries{Idem: filepath.Join(dir, "idem"), Lab: filepath.Join(dir, "idem-lab"), dir: dir}
	for bin, pkg := range map[string]string{b.Idem: "cmd/idem", b.Lab: "cmd/idem-lab"} {
		args := []string{"build", "-buildvcs=auto", "-o", bin}
		if race {
			args = append(args, "-race")
		}
		build := exec.Command("go", append(args, "github.com/idemhq/idem/"+pkg)...)
		build.Stdout, build.Stderr = os.Stderr, os.Stderr
		if err := build.Run(); err != nil {
			b.Remove()
			return Binaries{}, fmt.Errorf("build %s: %w", pkg, err)
		}
	}
	return b, nil
}

// waitingParallel is how many parallel tests a MainWithBinaries package
// runs at once by default.
const waitingParallel = 4

// Remove removes the binaries.
func (b Binaries) Remove() { os.RemoveAll(b.dir) }

// MainWithBinaries is the TestMain of a package whose tests run idem's
// binaries: it builds them (BuildBinaries), sets idem and lab to their
// paths, runs the tests, removes the binaries and exits.
//
// Unless -parallel is given, the package runs waitingParallel parallel
// tests at once rather than GOMAXPROCS: its tests mostly wait on the
// processes they start, and test/e2e alone at two at a time left a
// two-core machine idle 40% of its run.
func MainWithBinaries(m *testing.M, race bool, idem, lab *string) {
	flag.Parse()
	given := false
	flag.Visit(func(f *flag.Flag) { given = given || f.Name == "test.parallel" })
	if !given {
		if err := flag.Set("test.parallel", strconv.Itoa(max(waitingParallel, runtime.GOMAXPROCS(0)))); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	bins, err := BuildBinaries(race)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	*idem, *lab = bins.Idem, bins.Lab
	code := m.Run()
	bins.Remove()
	os.Exit(code)
}

// ConsumerVars is the environment the tests' `idem consume` processes run
// with: the services' URLs, the queue and Redis prefix of the test's own,
// and settings that keep a test's run short (small batches, quick retries
// and breaker, a 10 s drain).
func ConsumerVars(dbURL, amqpURL, redisURL, queue, prefix string) []string {
	return []string{
		"DATABASE_URL=" + dbURL,
		"AMQP_URL=" + amqpURL,
		"REDIS_URL=" + redisURL,
		"IDEM_QUEUE=" + queue,
		"IDEM_REDIS_PREFIX=" + prefix,
		"IDEM_CONSUMER_PREFETCH=32",
		"IDEM_CONSUMER_WORKERS=4",
		"IDEM_CONSUMER_BATCH_SIZE=16",
		"IDEM_CONSUMER_RETRY_BACKOFF_MIN=20ms",
		"IDEM_CONSUMER_RETRY_BACKOFF_MAX=200ms",
		"IDEM_CONSUMER_DRAIN_TIMEOUT=10s",
		"IDEM_REDIS_BREAKER_OPEN_TIMEOUT=300ms",
		"IDEM_POSTGRES_MAX_CONNS=12",
	}
}

// DumpLogs logs the last 40 lines of each process's log, for a test that
// failed.
func DumpLogs(t testing.TB, procs []*fleet.Proc) {
	for _, p := range procs {
		b, _ := os.ReadFile(p.LogPath)
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		if len(lines) > 40 {
			lines = lines[len(lines)-40:]
		}
		t.Logf("--- last lines of %s:\n%s", p.Name, strings.Join(lines, "\n"))
	}
}

// WaitConsuming waits until p logged that it consumes, or exited.
func WaitConsuming(t testing.TB, p *fleet.Proc) {
	t.Helper()
	require.Eventually(t, func() bool {
		select {
		case <-p.Done():
			return true
		default:
		}
		return p.LogContains("msg=consuming")
	}, 60*time.Second, 10*time.Millisecond, "%s never started consuming", p.Name)
}

// ExitCode is the exit status of a command that ended with err: -1 if it
// did not run or was killed.
func ExitCode(err error) int {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	if err != nil {
		return -1
	}
	return 0
}
