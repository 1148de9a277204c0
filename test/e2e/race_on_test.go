//go:build race

package e2e

// raceEnabled builds the consumers under test with -race too, so the race
// detector also watches the real processes.
const raceEnabled = true
