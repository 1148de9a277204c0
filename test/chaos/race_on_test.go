//go:build race

package chaos

// raceEnabled builds the harness, and so the consumers it runs, with -race
// too, so the race detector also watches the real processes.
const raceEnabled = true
