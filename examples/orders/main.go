// Command orders is a second service built only on idem's public API: it
// records each ORDER_SHIPPED event once in its own shipments table, however
// often RabbitMQ delivers it, across a fleet of its own processes, crashes
// and Redis outages.
//
// With ORDERS_NOTIFY_URL set it also tells each customer, once, that their
// order shipped: a POST to the notifications API with the bearer token
// ORDERS_NOTIFY_TOKEN, sent through the outbox by the relay that the
// service runs itself. No second process, and nothing but its own code
// names the destination.
//
// It reads DATABASE_URL, AMQP_URL, REDIS_URL (empty: Postgres alone),
// ORDERS_QUEUE (default orders.events), ORDERS_HTTP_ADDR (the probes and
// /metrics, if set), ORDERS_NOTIFY_URL and ORDERS_NOTIFY_TOKEN, applies its
// migrations, and runs until SIGTERM.
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/idemhq/idem/migrations"
	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/idem"
	"github.com/idemhq/idem/pkg/outbox"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	if err := run(ctx, os.Getenv, log); err != nil {
		log.Error("orders", "err", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, getenv func(string) string, log *slog.Logger) error {
	// docs:begin
	reg := prometheus.NewRegistry()
	cfg := idem.Config{
		Scope:       "orders",
		DatabaseURL: getenv("DATABASE_URL"),
		RedisURL:    getenv("REDIS_URL"), // empty: Postgres alone
		Consumer: consumer.Config{
			URL:   getenv("AMQP_URL"),
			Queue: or(getenv("ORDERS_QUEUE"), "orders.events"),
		},
		Migrate:    true,
		Migrations: []migrations.Set{Migrations},
		Metrics:    reg,
		Logger:     log,
	}
	h := Handler{}
	if url := getenv("ORDERS_NOTIFY_URL"); url != "" {
		// Notices go through the outbox; Run relays them, in this process.
		cfg.Outbox.Destinations = map[string]outbox.Destination{Notifications: {
			URL:    url,
			Header: http.Header{"Authorization": {"Bearer " + getenv("ORDERS_NOTIFY_TOKEN")}},
		}}
		h.Notify = true
	}
	svc, err := idem.New(cfg, h)
	if err != nil {
		return err
	}
	if addr := getenv("ORDERS_HTTP_ADDR"); addr != "" {
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		mux.Handle("/", svc.Health()) // /healthz and /readyz
		stopServing, err := serve(addr, mux)
		if err != nil {
			return err
		}
		defer stopServing()
	}
	return svc.Run(ctx) // until SIGTERM, then drain
	// docs:end
}

// serve serves h on addr until the returned func is called.
func serve(addr string, h http.Handler) (func(), error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("ORDERS_HTTP_ADDR: %w", err)
	}
	// Probes and scrapes send no body and read a small answer: drop a
	// client that is slow or idle rather than hold its connection.
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       5 * time.Second,
		WriteTimeout:      10 * time.Second,
		IdleTimeout:       60 * time.Second,
	}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			slog.Error("http", "err", err)
		}
	}()
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	}, nil
}

func or(s, def string) string {
	if s == "" {
		return def
	}
	return s
}
