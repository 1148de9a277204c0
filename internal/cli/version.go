package cli

import (
	"context"
	"fmt"
	"runtime/debug"
)

// Release is the version of this tree, as CHANGELOG.md's latest release
// heading names it.
const Release = "0.1.0"

// Version describes the running binary: the release, and from its build
// info the module version (or "(devel)"), the VCS revision and whether the
// tree was modified.
func Version() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "idem " + Release + " (no build info)"
	}
	rev, modified, when := "unknown", "", ""
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			if s.Value == "true" {
				modified = " (modified)"
			}
		case "vcs.time":
			when = " " + s.Value
		}
	}
	return fmt.Sprintf("idem %s (%s %s %s%s%s %s)", Release, bi.Main.Path, bi.Main.Version, rev, modified, when, bi.GoVersion)
}

func runVersion(_ context.Context, e *Env, args []string) error {
	fs := NewFlags(e, "version", "Prints the module version, VCS revision and Go version of this binary.")
	if err := Parse(fs, args); err != nil {
		return err
	}
	fmt.Fprintln(e.Stdout, Version())
	return nil
}
