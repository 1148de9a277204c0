package cli

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"
)

func runProbe(ctx context.Context, e *Env, args []string) error {
	fs := NewFlags(e, "probe", `Asks a running consumer's health endpoint on metrics_addr and exits 0 if it
answers 2xx, 1 otherwise: a container healthcheck for images without curl.
/readyz: consuming, and Postgres answers. /healthz: the process is alive.`)
	path := fs.String("config", "", "YAML config `file`")
	probePath := fs.String("path", "/readyz", "endpoint: /readyz or /healthz")
	timeout := fs.Duration("timeout", 2*time.Second, "how long to wait for the answer")
	if err := Parse(fs, args); err != nil {
		return err
	}
	cfg, _, err := e.LoadConfig(*path)
	if err != nil {
		return err
	}
	if cfg.MetricsAddr == "" {
		return fmt.Errorf("probe: metrics_addr is not set, so the consumer serves no health endpoint")
	}
	host, port, err := net.SplitHostPort(cfg.MetricsAddr)
	if err != nil {
		return fmt.Errorf("probe: metrics_addr %q: %w", cfg.MetricsAddr, err)
	}
	if host == "" || host == "0.0.0.0" || host == "::" {
		host = "127.0.0.1"
	}
	url := "http://" + net.JoinHostPort(host, port) + "/" + strings.TrimPrefix(*probePath, "/")
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return fmt.Errorf("probe: %w", err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("probe %s: %w", url, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	fmt.Fprint(e.Stdout, string(body))
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("probe %s: %s", url, resp.Status)
	}
	return nil
}
