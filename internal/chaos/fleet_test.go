package chaos

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestArmedConsumersAreNotReplacedBeforeTheyFire: a consumer fault aimed at
// a slot whose armed consumer has not died yet goes to the next slot, so
// every armed crash point keeps its chance to fire.
func TestArmedConsumersAreNotReplacedBeforeTheyFire(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "consumer")
	require.NoError(t, os.WriteFile(bin, []byte("#!/bin/sh\nexec sleep 60\n"), 0o755))
	c, err := startConsumers(Options{Bin: bin, Consumers: 3, Dir: dir}, "t-c", func(int) []string { return nil }, time.Now())
	require.NoError(t, err)
	t.Cleanup(c.KillAll)

	_, err = c.arm(1, "after_apply", 5)
	require.NoError(t, err)
	require.Equal(t, 2, c.target(1), "slot 1 runs an armed consumer that has not fired")
	require.Equal(t, 0, c.target(0))
	_, err = c.arm(1, "before_ack", 5) // retargeted to slot 2
	require.NoError(t, err)
	require.Equal(t, 0, c.target(1), "slots 1 and 2 are both armed")

	armed := c.Current(1)
	armed.Kill() // it "fired"
	<-armed.Done()
	require.Equal(t, 1, c.target(1), "once the armed consumer died, its slot is fair game")
}
