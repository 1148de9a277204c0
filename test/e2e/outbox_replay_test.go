package e2e

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/redact"
	"github.com/idemhq/idem/internal/testenv"
)

// TestOutboxReplayNeverTakesTooMuch: `idem outbox replay --id` with no id in
// its list (",", " ") replayed every dead row, and with postgres.shards
// `--id 1` replayed row 1 of every shard. Both are refused as usage errors;
// `--shard S --id N` replays that one row. And `idem outbox list` masks the
// token an HTTP destination's URL holds, in the LAST ERROR a relay stored.
func TestOutboxReplayNeverTakesTooMuch(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	const token = "Zq7sentinelTOKEN"
	p0, s0 := testenv.Schema(t)
	p1, s1 := testenv.Schema(t)
	for _, p := range []*pgxpool.Pool{p0, p1} {
		// Row 1 of each shard, dead, with an error written before the relay
		// masked URLs: one quoting the URL, one the token alone.
		_, err := p.Exec(context.Background(), `INSERT INTO idem_outbox (scope, event_id, idx, destination, lane, body, state, attempts, last_error) VALUES
			('pay', 'e1', 0, 'api', 0, '', 'dead', 1, 'http: Post "https://api.example.com/x?access_token=`+token+`": dial tcp: connection refused'),
			('pay', 'e2', 0, 'api', 0, '', 'dead', 1, 'http 401: bad token `+token+`')`)
		require.NoError(t, err)
	}
	vars := []string{"IDEM_POSTGRES_SHARDS=" + s0 + " " + s1,
		"IDEM_OUTBOX_DESTINATIONS=api=https://api.example.com/x?access_token=" + token}
	dead := func(p *pgxpool.Pool) int {
		var n int
		require.NoError(t, p.QueryRow(context.Background(), `SELECT count(*) FROM idem_outbox WHERE state = 'dead'`).Scan(&n))
		return n
	}

	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--id", ","}, `--id "," names no row (to replay every dead row, give --all-dead)`},
		{[]string{"--id", " "}, `--id " " names no row`},
		{[]string{"--id", "1"}, "row ids are per shard and postgres.shards lists 2; add --shard S"},
		{[]string{"--shard", "2", "--id", "1"}, "--shard 2: postgres.shards lists 2 shard(s), numbered from 0"},
	} {
		r := e.run(vars, append([]string{"outbox", "replay"}, c.args...)...)
		require.Equal(t, 2, r.code, "%v: %s", c.args, r.out)
		require.Contains(t, r.out, c.want, c.args)
	}
	require.Equal(t, 2, dead(p0), "a refused replay replays nothing")
	require.Equal(t, 2, dead(p1))

	r := e.run(vars, "outbox", "replay", "--shard", "1", "--id", "1")
	require.Equal(t, 0, r.code, r.out)
	require.Contains(t, r.out, "shard 1: 1 dead row(s) pending again")
	require.Equal(t, 2, dead(p0), "shard 0's row 1 is another row")
	require.Equal(t, 1, dead(p1))

	r = e.run(vars, "outbox", "list", "--dead")
	require.Equal(t, 0, r.code, r.out)
	require.Contains(t, r.out, "shard 0: 1")
	require.NotContains(t, r.out, token)
	require.Contains(t, r.out, "access_token="+redact.Mask)
	require.Contains(t, r.out, "bad token "+redact.Mask)

	r = e.run(nil, "outbox", "replay", "-h")
	require.Contains(t, r.out, "replay --id N needs --shard S")
}

// TestOutboxToolsKeepToOneServiceAndDestination: a database that several
// services' relays share holds every service's rows. `idem outbox list`
// takes --scope, --destination and --state (it had none of the first two:
// "flag provided but not defined: -scope"), and `idem outbox replay
// --all-dead` keeps to the same filters, so an operator replays one
// destination's dead rows without touching another service's.
func TestOutboxToolsKeepToOneServiceAndDestination(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	p, url := testenv.Schema(t)
	_, err := p.Exec(context.Background(), `INSERT INTO idem_outbox (scope, event_id, idx, destination, lane, body, state, attempts, last_error) VALUES
		('pay', 'e1', 0, 'api', 0, '', 'dead', 1, 'http 500'),
		('pay', 'e2', 0, 'mail', 0, '', 'pending', 0, NULL),
		('refunds', 'e3', 0, 'api', 0, '', 'dead', 1, 'http 401'),
		('refunds', 'e4', 0, 'api', 0, '', 'sent', 1, NULL),
		('refunds', 'e5', 0, 'audit', 0, '', 'dead', 1, 'no route')`)
	require.NoError(t, err)
	vars := []string{"DATABASE_URL=" + url, "IDEM_OUTBOX_DESTINATIONS=api=https://api.example.com/x mail=queue:mail audit=queue:audit"}
	list := func(args ...string) string {
		t.Helper()
		r := e.run(vars, append([]string{"outbox", "list"}, args...)...)
		require.Equal(t, 0, r.code, r.out)
		return r.out
	}
	shows := func(out string, events ...string) {
		t.Helper()
		for _, ev := range []string{"e1", "e2", "e3", "e4", "e5"} {
			if slices.Contains(events, ev) {
				require.Contains(t, out, "/"+ev+"#", out)
			} else {
				require.NotContains(t, out, "/"+ev+"#", out)
			}
		}
	}
	shows(list("--scope", "pay"), "e1", "e2")
	shows(list("--destination", "api"), "e1", "e3", "e4")
	shows(list("--destination", "api", "--state", "dead"), "e1", "e3")
	shows(list("--scope", "refunds", "--dead"), "e3", "e5")
	shows(list("--state", "sent"), "e4")

	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"list", "--state", "stuck"}, `--state "stuck": want one of pending, sent, dead`},
		{[]string{"list", "--state", "dead", "--pending"}, "one of --state, --dead and --pending"},
	} {
		r := e.run(vars, append([]string{"outbox"}, c.args...)...)
		require.Equal(t, 2, r.code, "%v: %s", c.args, r.out)
		require.Contains(t, r.out, c.want)
	}

	r := e.run(vars, "outbox", "replay", "--all-dead", "--scope", "refunds", "--destination", "api")
	require.Equal(t, 0, r.code, r.out)
	require.Contains(t, r.out, "1 dead row(s) pending again")
	shows(list("--dead"), "e1", "e5")
}

// TestOutboxResendTakesOneDestinationsSentRows: `idem outbox resend` makes
// the sent rows of one destination pending again, those sent since --since
// only, for messages lost after their destination took them (a queue deleted
// with its messages in it). It needs --destination and --since, and
// --dry-run changes nothing.
func TestOutboxResendTakesOneDestinationsSentRows(t *testing.T) {
	t.Parallel()
	e := newEnv(t, "", "")
	p, url := testenv.Schema(t)
	_, err := p.Exec(context.Background(), `INSERT INTO idem_outbox (scope, event_id, idx, destination, lane, body, state, attempts, sent_at) VALUES
		('pay', 'old', 0, 'audit', 0, '', 'sent', 1, now() - interval '2 hours'),
		('pay', 'new', 0, 'audit', 0, '', 'sent', 3, now() - interval '1 minute'),
		('pay', 'other', 0, 'api', 0, '', 'sent', 1, now() - interval '1 minute'),
		('refunds', 'theirs', 0, 'audit', 0, '', 'sent', 1, now() - interval '1 minute'),
		('pay', 'dead', 0, 'audit', 0, '', 'dead', 9, NULL)`)
	require.NoError(t, err)
	vars := []string{"DATABASE_URL=" + url, "IDEM_OUTBOX_DESTINATIONS=api=https://api.example.com/x audit=queue:audit"}
	pending := func() []string {
		rows, err := p.Query(context.Background(), `SELECT event_id FROM idem_outbox WHERE state = 'pending' AND attempts = 0 ORDER BY event_id`)
		require.NoError(t, err)
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return ids
	}

	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--since", "1h"}, "give --destination"},
		{[]string{"--destination", "audit"}, "give --since"},
		{[]string{"--destination", "audit", "--since", "yesterday"}, `--since "yesterday": want a positive duration`},
		{[]string{"--destination", "audit", "--since", "-5m"}, `--since "-5m"`},
	} {
		r := e.run(vars, append([]string{"outbox", "resend"}, c.args...)...)
		require.Equal(t, 2, r.code, "%v: %s", c.args, r.out)
		require.Contains(t, r.out, c.want, c.args)
	}
	require.Empty(t, pending(), "a refused resend changes nothing")

	r := e.run(vars, "outbox", "resend", "--destination", "audit", "--scope", "pay", "--since", "1h", "--dry-run")
	require.Equal(t, 0, r.code, r.out)
	require.Contains(t, r.out, "1 row(s) of audit sent in the last 1h0m0s would be pending again")
	require.Empty(t, pending(), "--dry-run changes nothing")

	r = e.run(vars, "outbox", "resend", "--destination", "audit", "--scope", "pay", "--since", "1h")
	require.Equal(t, 0, r.code, r.out)
	require.Contains(t, r.out, "1 row(s) of audit sent in the last 1h0m0s pending again")
	require.NotContains(t, r.out, "note:")
	require.Equal(t, []string{"new"}, pending(), "only pay's audit row sent within the hour")

	r = e.run(vars, "outbox", "resend", "--destination", "audit", "--since", time.Now().Add(-3*time.Hour).UTC().Format(time.RFC3339))
	require.Equal(t, 0, r.code, r.out)
	require.Contains(t, r.out, "2 row(s) of audit sent since ")
	require.Equal(t, []string{"new", "old", "theirs"}, pending(), "the dead row and the api row stay as they were")

	// A window longer than the relays keep sent rows is said.
	r = e.run(vars, "outbox", "resend", "--destination", "audit", "--since", "48h", "--dry-run")
	require.Equal(t, 0, r.code, r.out)
	require.Contains(t, r.out, "note: relays keep sent rows outbox.retention (24h0m0s here)")
}
