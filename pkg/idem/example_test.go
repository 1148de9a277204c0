package idem_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/idem"
)

// greeting is a handler: it records each greeting once in greetings, a
// table this example creates.
type greeting struct{}

// Decode leaves the event's Time zero: the consumer then takes the AMQP
// timestamp the producer set. Never stamp time.Now() here: a copy
// redelivered after the retention would look new, and be applied again.
func (greeting) Decode(m consumer.Message) (guard.Event, string, error) {
	id, name, _ := strings.Cut(string(m.Body), ":")
	return guard.Event{ID: id, Hash: guard.HashFields(id, name)}, name, nil
}

func (greeting) Apply(ctx context.Context, tx pgx.Tx, name string) error {
	_, err := tx.Exec(ctx, `INSERT INTO greetings (name) VALUES ($1)`, name)
	return err
}

// A service with only the required settings: the defaults are the safe
// ones. The broker delivers "g1" twice; it is applied once.
func Example() {
	dbURL, amqpURL, queue, cleanup := exampleServices()
	defer cleanup()

	svc, err := idem.New(idem.Config{
		Scope:       "greeter",
		DatabaseURL: dbURL,
		Consumer:    consumer.Config{URL: amqpURL, Queue: queue},
		Migrate:     true, // the guard's tables
		Logger:      slog.New(slog.DiscardHandler),
	}, greeting{})
	if err != nil {
		panic(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- svc.Run(ctx) }()

	publish(amqpURL, queue, "g1:Ada", "g1:Ada", "g2:Grace")
	fmt.Println("greetings:", waitRows(dbURL, 2))
	stop()
	fmt.Println("stopped:", <-done)
	// Output:
	// greetings: 2
	// stopped: <nil>
}

// Health serves /healthz and /readyz; /readyz says what is not ready yet.
func ExampleService_Health() {
	svc, err := idem.New(idem.Config{
		Scope:       "greeter",
		DatabaseURL: env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"),
		Consumer:    consumer.Config{URL: "amqp://guest:guest@127.0.0.1:5672/", Queue: "greetings"},
	}, greeting{})
	if err != nil {
		panic(err)
	}
	rec := httptest.NewRecorder()
	svc.Health().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
	lines := strings.Split(rec.Body.String(), "\n")
	fmt.Println(rec.Code, lines[0])
	fmt.Println(lines[1])
	// Output:
	// 503 not ready
	// consumer: failing: not consuming (starting, or reconnecting to RabbitMQ)
}

// An unsafe combination is an error from New, not a silent hole.
func ExampleNew_unsafe() {
	_, err := idem.New(idem.Config{
		Scope:       "greeter",
		DatabaseURL: "postgres://127.0.0.1/test",
		RedisURL:    "redis://127.0.0.1:6379/0",
		Consumer:    consumer.Config{URL: "amqp://127.0.0.1/", Queue: "greetings", Retention: 12 * time.Hour},
	}, greeting{})
	fmt.Println(err)
	// Output:
	// idem: Fast.DoneTTL 24h0m0s exceeds Consumer.Retention 12h0m0s: Redis would vouch for events Postgres has forgotten
}

// exampleServices returns a fresh schema with a greetings table, the
// broker and a fresh queue name, and a func that removes them.
func exampleServices() (dbURL, amqpURL, queue string, cleanup func()) {
	ctx := context.Background()
	base := env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
	schema := fmt.Sprintf("example_%d", time.Now().UnixNano())
	conn, err := pgx.Connect(ctx, base)
	if err != nil {
		panic(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `CREATE SCHEMA `+schema+`; CREATE TABLE `+schema+`.greetings (name text NOT NULL)`); err != nil {
		panic(err)
	}
	sep := "?"
	if strings.Contains(base, "?") {
		sep = "&"
	}
	amqpURL = env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
	queue = "idem.example." + schema
	return base + sep + "search_path=" + schema, amqpURL, queue, func() {
		c, err := pgx.Connect(ctx, base)
		if err == nil {
			_, _ = c.Exec(ctx, `DROP SCHEMA `+schema+` CASCADE`)
			c.Close(ctx)
		}
		if ac, err := amqp.Dial(amqpURL); err == nil {
			if ch, err := ac.Channel(); err == nil {
				for _, q := range []string{queue, queue + ".dlq"} {
					_, _ = ch.QueueDelete(q, false, false, false)
				}
				_ = ch.ExchangeDelete(queue+".dlx", false, false)
			}
			ac.Close()
		}
	}
}

// publish sends bodies to queue once the service has declared it, each
// stamped with the time it was sent, as a producer does.
func publish(amqpURL, queue string, bodies ...string) {
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		panic(err)
	}
	defer conn.Close()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		ch, err := conn.Channel()
		if err != nil {
			panic(err)
		}
		if _, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil); err == nil {
			// Each message confirmed, as a producer does: a message the
			// broker nacks (a quorum queue busy on a loaded machine, say)
			// was not enqueued, and is published again.
			if err := ch.Confirm(false); err != nil {
				panic(err)
			}
			for _, b := range bodies {
				for !publishConfirmed(ch, queue, b) {
					if time.Now().After(deadline) {
						panic(fmt.Sprintf("the broker nacked %q until the deadline", b))
					}
					time.Sleep(50 * time.Millisecond)
				}
			}
			return
		}
		if time.Now().After(deadline) {
			panic("the service never declared its queue")
		}
	}
}

// publishConfirmed publishes body to queue on ch, a channel in confirm
// mode, and reports whether the broker confirmed it.
func publishConfirmed(ch *amqp.Channel, queue, body string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, false, false,
		amqp.Publishing{Body: []byte(body), Timestamp: time.Now()})
	if err != nil {
		panic(err)
	}
	return c.Wait()
}

// waitRows waits until greetings holds at least n rows, and returns how
// many it holds a moment later.
func waitRows(dbURL string, n int) int {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		panic(err)
	}
	defer conn.Close(ctx)
	var rows int
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM greetings`).Scan(&rows); err != nil {
			panic(err)
		}
		if rows >= n {
			time.Sleep(200 * time.Millisecond) // a duplicate would land now
			_ = conn.QueryRow(ctx, `SELECT count(*) FROM greetings`).Scan(&rows)
			break
		}
	}
	return rows
}

func env(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}
