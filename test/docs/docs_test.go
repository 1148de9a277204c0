// Package docs checks that the documentation agrees with the code: every Go
// snippet in README.md and docs/ is a marked region of a compiled file, and
// the numbers quoted from the checked-in chaos reports are the reports'.
package docs

import (
	"html"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// root is the repository, from this package's directory.
const root = "../.."

// TestGoSnippetsAreCompiledCode: each ```go block of the docs is, line for
// line (indentation aside), a region between "// docs:begin" and
// "// docs:end" of a Go file that the build or the tests compile.
func TestGoSnippetsAreCompiledCode(t *testing.T) {
	regions := markedRegions(t)
	require.NotEmpty(t, regions)
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	require.NoError(t, err)
	snippets := 0
	for _, doc := range append(docs, filepath.Join(root, "README.md")) {
		b, err := os.ReadFile(doc)
		require.NoError(t, err)
		for _, m := range regexp.MustCompile("(?s)```go\n(.*?)```").FindAllStringSubmatch(string(b), -1) {
			snippets++
			snippet := normalize(m[1])
			found := false
			for _, r := range regions {
				found = found || r == snippet
			}
			require.True(t, found, "%s: this Go snippet is not a docs:begin/docs:end region of any compiled file:\n%s", doc, m[1])
		}
	}
	require.GreaterOrEqual(t, snippets, 3)
}

// markedRegions returns every docs:begin … docs:end region of the
// repository's Go files, normalized.
func markedRegions(t *testing.T) []string {
	var out []string
	err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "node_modules") {
			return filepath.SkipDir
		}
		if !strings.HasSuffix(path, ".go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range regexp.MustCompile(`(?s)// docs:begin\n(.*?)\n[ \t]*// docs:end`).FindAllStringSubmatch(string(b), -1) {
			out = append(out, normalize(m[1]))
		}
		return nil
	})
	require.NoError(t, err)
	return out
}

// normalize drops blank lines and each line's indentation and trailing
// space.
func normalize(s string) string {
	var lines []string
	for _, l := range strings.Split(s, "\n") {
		if l = strings.TrimSpace(l); l != "" {
			lines = append(lines, l)
		}
	}
	return strings.Join(lines, "\n")
}

// TestTheOpenTelemetryExampleCompiles: docs/operations.md's tracing
// observer lives in a module of its own (examples/otel), so that idem does
// not depend on OpenTelemetry. It must compile against this tree.
func TestTheOpenTelemetryExampleCompiles(t *testing.T) {
	if testing.Short() {
		t.Skip("downloads OpenTelemetry's modules")
	}
	// With -race, as make test and CI's vet build, so that idem and its
	// dependencies come from the build cache: without it, they were all
	// compiled again without the race detector, 100 s of CPU on an
	// empty cache beside the other packages' tests.
	cmd := exec.Command("go", "vet", "-race", "./...")
	cmd.Dir = filepath.Join(root, "examples", "otel")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
}

// report is what a checked-in chaos report says of its run.
type report struct {
	seed, messages, faults string
}

// readReport reads the run's headline from a chaos HTML report.
func readReport(t *testing.T, name string) report {
	b, err := os.ReadFile(filepath.Join(root, "docs", name))
	require.NoError(t, err)
	text := html.UnescapeString(regexp.MustCompile(`<[^>]+>`).ReplaceAllString(string(b), " "))
	m := regexp.MustCompile(`(?s)Seed (\d+),.*?stream of (\d+) messages.*?; (\d+) faults`).FindStringSubmatch(text)
	require.NotNil(t, m, "%s has no headline", name)
	return report{seed: m[1], messages: thousands(m[2]), faults: m[3]}
}

// thousands writes n with commas, as the docs do.
func thousands(n string) string {
	for i := len(n) - 3; i > 0; i -= 3 {
		n = n[:i] + "," + n[i:]
	}
	return n
}

// TestDocsQuoteTheChaosReports: the seeds, message and fault counts the
// docs quote for a chaos run are the ones its checked-in report shows.
func TestDocsQuoteTheChaosReports(t *testing.T) {
	read := func(name string) string {
		b, err := os.ReadFile(filepath.Join(root, name))
		require.NoError(t, err)
		return strings.Join(strings.Fields(string(b)), " ")
	}
	readme, design, scale := read("README.md"), read("docs/design.md"), read("docs/scale.md")

	ten := readReport(t, "chaos-10m.html")
	require.Contains(t, readme, "The ten-minute run with seed "+ten.seed+" injected "+ten.faults+" faults into "+ten.messages+" messages")
	require.Contains(t, design, "idem-lab chaos --duration 10m --seed "+ten.seed)
	require.Contains(t, design, ten.messages+" messages")
	require.Contains(t, design, ten.faults+" faults")

	// The two-hop run with failovers is the one the docs tell; the one
	// before the failovers is cited beside it.
	failover := readReport(t, "chaos-failover-10m.html")
	require.Contains(t, design, "idem-lab chaos --duration 10m --seed "+failover.seed)
	require.Contains(t, design, failover.messages+" messages, 144,000 payments, "+failover.faults+" faults")
	require.Contains(t, readme, "seed "+failover.seed+" ran "+failover.messages+" messages")
	two := readReport(t, "chaos-two-hops-10m.html")
	require.Contains(t, design, "(seed "+two.seed+", "+two.faults+" faults)")

	cluster := readReport(t, "chaos-cluster.html")
	require.Contains(t, scale, "--seed "+cluster.seed)
	require.Contains(t, scale, cluster.messages+" messages")
	require.Contains(t, scale, cluster.faults+" faults")
}
