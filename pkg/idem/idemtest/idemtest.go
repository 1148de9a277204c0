// Package idemtest helps a service's tests run it against real PostgreSQL
// and RabbitMQ, as idem's own tests do: a schema and a stream of the
// test's own, removed when the test ends, so that tests run in parallel
// and never see each other's data; events published to the stream with
// confirms; and how many messages wait in its queues.
package idemtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
)

// timeout bounds each of the helpers' waits.
const timeout = 30 * time.Second

// name returns a short unique name for a test's resources.
func name() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return "t" + hex.EncodeToString(b[:])
}

// Schema creates an empty schema of the test's own on the server at
// databaseURL and returns a pool and a URL confined to it (search_path),
// for the service under test (which creates its tables, with
// idem.Config.Migrate) or a process it starts. The schema and all in it
// are dropped at the end.
func Schema(t testing.TB, databaseURL string) (*pgxpool.Pool, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	schema := name()
	admin, err := pgx.Connect(ctx, databaseURL)
	if err != nil {
		t.Fatalf("idemtest: connect to postgres: %v", err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatalf("idemtest: create schema: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		c, err := pgx.Connect(ctx, databaseURL)
		if err == nil {
			defer c.Close(ctx)
			_, err = c.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE")
		}
		if err != nil {
			t.Logf("idemtest: drop schema %s: %v", schema, err)
		}
	})
	u, err := url.Parse(databaseURL)
	if err != nil || u.Scheme == "" {
		t.Fatalf("idemtest: Schema takes a postgres:// URL")
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	pool, err := pgxpool.New(ctx, u.String())
	if err != nil {
		t.Fatalf("idemtest: pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool, u.String()
}

// Stream returns a queue name of the test's own, for a service's
// consumer.Config.Queue (unpartitioned). Its queue, dead-letter queue
// (<queue>.dlq) and dead-letter exchange are deleted from amqpURL's vhost
// at the end.
func Stream(t testing.TB, amqpURL string) string {
	t.Helper()
	q := "idemtest." + name()
	t.Cleanup(func() {
		err := withChannel(amqpURL, func(ch *amqp.Channel) error {
			_, err1 := ch.QueueDelete(q, false, false, false)
			_, err2 := ch.QueueDelete(q+".dlq", false, false, false)
			return errors.Join(err1, err2, ch.ExchangeDelete(q+".dlx", false, false))
		})
		if err != nil {
			t.Logf("idemtest: delete stream %s: %v", q, err)
		}
	})
	return q
}

// Publish sends bodies to queue, persistent and each confirmed by the
// broker, once the service under test has declared it (it waits up to
// 30 s for that, and sends again what a queue just declared nacks). Each is
// stamped with the time it is sent, as a producer does.
func Publish(t testing.TB, amqpURL, queue string, bodies ...[]byte) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for Depth(t, amqpURL, queue) < 0 {
		if time.Now().After(deadline) {
			t.Fatalf("idemtest: the service never declared %s", queue)
		}
		time.Sleep(20 * time.Millisecond)
	}
	err := withChannel(amqpURL, func(ch *amqp.Channel) error {
		if err := ch.Confirm(false); err != nil {
			return err
		}
		ctx, cancel := context.WithDeadline(context.Background(), deadline.Add(timeout))
		defer cancel()
		for len(bodies) > 0 {
			pending := make([]*amqp.DeferredConfirmation, len(bodies))
			for i, b := range bodies {
				dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, false, false, amqp.Publishing{
					DeliveryMode: amqp.Persistent, Timestamp: time.Now(), Body: b})
				if err != nil {
					return err
				}
				pending[i] = dc
			}
			var nacked [][]byte
			for i, dc := range pending {
				ok, err := dc.WaitContext(ctx)
				if err != nil {
					return err
				}
				if !ok {
					nacked = append(nacked, bodies[i])
				}
			}
			bodies = nacked
		}
		return nil
	})
	if err != nil {
		t.Fatalf("idemtest: publish to %s: %v", queue, err)
	}
}

// Depth returns how many messages are ready in queue (a stream's, or its
// dead-letter queue, <queue>.dlq), or -1 if it does not exist.
func Depth(t testing.TB, amqpURL, queue string) int {
	t.Helper()
	n := -1
	err := withChannel(amqpURL, func(ch *amqp.Channel) error {
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		var ae *amqp.Error
		if errors.As(err, &ae) && ae.Code == amqp.NotFound {
			return nil
		}
		n = q.Messages
		return err
	})
	if err != nil {
		t.Fatalf("idemtest: depth of %s: %v", queue, err)
	}
	return n
}

// withChannel runs fn on a channel of a connection of its own.
func withChannel(amqpURL string, fn func(*amqp.Channel) error) error {
	conn, err := amqp.DialConfig(amqpURL, amqp.Config{Dial: amqp.DefaultDial(timeout)})
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	return fn(ch)
}
