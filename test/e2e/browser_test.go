package e2e

import (
	"context"
	"os"
	"os/exec"
	"testing"

	"github.com/chromedp/chromedp"
)

// startBrowser starts a headless Chromium of the test's own (Debian's chromium,
// which .ci/services.sh installs) and returns a chromedp context for one
// tab; it ends with the test. Without chromium the test skips, or fails
// under CI.
func startBrowser(t testing.TB) context.Context {
	t.Helper()
	path := ""
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			path = p
			break
		}
	}
	if path == "" {
		if os.Getenv("CI") == "" {
			t.Skip("chromium is not installed (.ci/services.sh installs it)")
		}
		t.Fatal("e2e: chromium is not installed (.ci/services.sh installs it)")
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(path),
		chromedp.NoSandbox, // root in CI; the page is the test's own
		chromedp.DisableGPU,
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1400, 1000),
	)
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(actx, chromedp.WithLogf(t.Logf))
	// Start the browser now (the first run's context must have no
	// timeout: it would stop the browser; the test's own bounds it).
	if err := chromedp.Do(ctx); err != nil {
		cancel()
		cancelAlloc()
		t.Fatalf("e2e: start chromium: %v", err)
	}
	t.Cleanup(func() { cancel(); cancelAlloc() })
	return ctx
}
