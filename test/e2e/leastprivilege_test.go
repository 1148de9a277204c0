package e2e

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/loadgen"
	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
)

// documentedRoles reads docs/security.md's least-privilege blocks: the
// runtime role's SQL statements (with {role} and {schema} for its name and
// the schema's, and the migrator being the user of adminURL), and each
// RabbitMQ user's configure, write and read patterns for queue.
func documentedRoles(t *testing.T, adminURL, queue string) (grants []string, perms map[string][3]string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "docs", "security.md"))
	require.NoError(t, err)
	doc := string(b)
	sql := regexp.MustCompile("(?s)```sql\n(.*?)```").FindStringSubmatch(doc)
	require.NotNil(t, sql, "docs/security.md has no sql block")
	u, err := url.Parse(adminURL)
	require.NoError(t, err)
	migrator := "postgres"
	if u.User != nil && u.User.Username() != "" {
		migrator = u.User.Username()
	}
	schema := regexp.MustCompile(`\bapp\b`)
	for _, line := range strings.Split(sql[1], "\n") {
		line = strings.TrimSpace(line)
		if !strings.Contains(line, "idem_runtime") || strings.HasPrefix(line, "--") || strings.HasPrefix(line, "CREATE ROLE") {
			continue
		}
		line = strings.ReplaceAll(line, "idem_runtime", "{role}")
		line = strings.ReplaceAll(line, "idem_migrator", migrator)
		grants = append(grants, schema.ReplaceAllString(strings.TrimSuffix(line, ";"), "{schema}"))
	}
	require.Len(t, grants, 5, "the runtime role's statements: %q", grants)

	perms = map[string][3]string{}
	set := regexp.MustCompile(`(?m)^rabbitmqctl set_permissions -p / (\S+) '([^']*)' '([^']*)' '([^']*)'$`)
	for _, m := range set.FindAllStringSubmatch(doc, -1) {
		var p [3]string
		for i := range p {
			p[i] = strings.ReplaceAll(m[i+2], `payments\.events`, regexp.QuoteMeta(queue))
		}
		perms[m[1]] = p
	}
	require.Len(t, perms, 3, "the consumer's, the relay's and the tools' users")
	return grants, perms
}

// TestTheRuntimeRolesRunTheStream runs idem with the roles docs/security.md
// documents, made with its statements and patterns as written there: a
// PostgreSQL role that may only read and write rows (no CREATE), and one
// RabbitMQ user each for the consumer, the relay and the dlq tools. A
// consumer started without --no-migrate on the migrated schema applies
// events and sends their outbox messages, idem publish --no-migrate
// publishes, a relay relays, and the dlq tools list, show, replay and
// purge.
func TestTheRuntimeRolesRunTheStream(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	vhost := e.amqpURL
	receipts := testenv.Queue(t, vhost)
	e.vars = append(e.vars, "IDEM_OUTBOX_DESTINATIONS=receipts=queue:"+receipts, "IDEM_OUTBOX_POLL_INTERVAL=100ms")
	var adminDB string
	for _, v := range e.vars {
		if s, ok := strings.CutPrefix(v, "DATABASE_URL="); ok {
			adminDB = s
		}
	}
	grants, perms := documentedRoles(t, adminDB, e.queue)
	runtimeDB := "DATABASE_URL=" + testenv.Role(t, adminDB, grants...)
	// One user per line of the block, each with its patterns (set side
	// by side: rabbitmqctl takes a second or more a call).
	users := map[string]string{}
	for name := range perms {
		users[name], _ = testenv.User(t, vhost)
	}
	errs := make(chan error, len(perms))
	for name, p := range perms {
		go func() { errs <- sandbox.SetPermissions(users[name], p[0], p[1], p[2]) }()
	}
	for range perms {
		require.NoError(t, <-errs)
	}
	env := func(name string) string {
		u, ok := users[name]
		require.True(t, ok, "no permissions documented for %s", name)
		return "AMQP_URL=" + u
	}
	consumer, relay, tools := env("idem-consumer"), env("idem-relay"), env("idem-tools")
	ch := e.channel()
	_, err := ch.QueueDeclare(receipts, true, false, false, false, amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum})
	require.NoError(t, err)

	c := e.consume("c0", runtimeDB, consumer, "IDEM_OUTBOX_EMIT=receipts")
	e.waitConsuming(c)
	require.True(t, c.LogContains("msg=consuming"), "the consumer did not start")

	// idem publish, a load tool, declares the topology: the vhost's admin.
	path := filepath.Join(e.dir, "manifest.json")
	r := e.run([]string{runtimeDB}, "publish", "--no-migrate", "--quiet", "--count", "60", "--users", "10",
		"--dup-ratio", "0.25", "--delay-window", "20", "--manifest", path)
	require.Zero(t, r.code, r.out)
	m, err := loadgen.ReadManifest(path)
	require.NoError(t, err)
	e.waitApplied(m)

	e.relay("r0", runtimeDB, relay)
	require.Eventually(t, func() bool {
		return e.outboxStates()["sent"] == len(m.Events) && testenv.QueueDepth(t, vhost, receipts) == len(m.Events)
	}, 60*time.Second, 50*time.Millisecond, "the relay did not send every receipt")

	ok := func(args ...string) string {
		t.Helper()
		r := e.run([]string{runtimeDB, tools}, args...)
		require.Zero(t, r.code, "idem %v:\n%s", args, r.out)
		return r.out
	}
	dlqName := e.queue + ".dlq"
	waitDLQ := func(n int) {
		t.Helper()
		require.Eventually(t, func() bool { return testenv.QueueDepth(t, vhost, dlqName) == n },
			60*time.Second, 20*time.Millisecond, "the DLQ never held %d", n)
	}
	e.publishRaw(body(`{"eventId":`))
	waitDLQ(1)
	require.Contains(t, ok("dlq", "list"), dlqName+": 1 dead letters")
	require.Regexp(t, `reason:\s+invalid_json\n`, ok("dlq", "show"))
	require.Contains(t, ok("dlq", "replay", "--all"), "replayed 1 dead letters")
	require.Eventually(t, func() bool { return c.LogContains("invalid_json") && testenv.QueueDepth(t, vhost, dlqName) == 1 },
		60*time.Second, 20*time.Millisecond, "the replay did not come back")
	require.Contains(t, ok("dlq", "purge", "--yes"), "purged 1 dead letters")
	waitDLQ(0)
	ok("verify", "--manifest", path) // exits 1 on a missing or doubled effect
	id := m.Events[0].EventID
	require.Contains(t, ok("inspect", id), id)
	e.stopAll()
}

// TestPublishNoMigrateRefusesAnUnmigratedDatabase: idem publish
// --no-migrate creates nothing, and says what is missing.
func TestPublishNoMigrateRefusesAnUnmigratedDatabase(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	_, err := e.pool.Exec(context.Background(), `DROP TABLE idem_migrations, idem_stream`)
	require.NoError(t, err)
	r := e.run(nil, "publish", "--no-migrate", "--quiet", "--count", "1")
	require.NotZero(t, r.code, r.out)
	require.Contains(t, r.out, "idem's tables are missing", r.out)
	require.Contains(t, r.out, "without --no-migrate")
	var n int
	require.NoError(t, e.pool.QueryRow(context.Background(),
		`SELECT count(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename IN ('idem_migrations', 'idem_stream')`).Scan(&n))
	require.Zero(t, n, "it migrated")
	require.Equal(t, -1, testenv.QueueDepth(t, e.amqpURL, e.queue), fmt.Sprintf("it published:\n%s", r.out))
}
