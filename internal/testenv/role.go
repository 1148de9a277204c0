package testenv

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Role creates a PostgreSQL login role of the test's own, with no privilege
// but those grants give it, and returns schemaURL (a URL from Schema or
// SchemaOn) logging in as it. Each of grants is a statement run by
// schemaURL's user, with {role} and {schema} standing for the role's name
// and the schema's (schemaURL's search_path). The role is dropped at the
// end. It relies on the server trusting local logins, as the test servers
// do.
func Role(t testing.TB, schemaURL string, grants ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	u, err := url.Parse(schemaURL)
	if err != nil {
		t.Fatalf("testenv: database URL: %v", err)
	}
	schema := u.Query().Get("search_path")
	role := "idem_role_" + Name(t)
	admin, err := pgx.Connect(ctx, schemaURL)
	if err != nil {
		t.Fatalf("testenv: connect to postgres: %v", err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE ROLE "+role+" LOGIN"); err != nil {
		t.Fatalf("testenv: create role: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		c, err := pgx.Connect(ctx, schemaURL)
		if err != nil {
			t.Logf("testenv: drop role %s: %v", role, err)
			return
		}
		defer c.Close(ctx)
		// DROP OWNED revokes its grants, default privileges included.
		if _, err := c.Exec(ctx, "DROP OWNED BY "+role+"; DROP ROLE "+role); err != nil {
			t.Logf("testenv: drop role %s: %v", role, err)
		}
	})
	for _, g := range grants {
		stmt := strings.NewReplacer("{role}", role, "{schema}", schema).Replace(g)
		if _, err := admin.Exec(ctx, stmt); err != nil {
			t.Fatalf("testenv: %s: %v", stmt, err)
		}
	}
	u.User = url.User(role)
	return u.String()
}
