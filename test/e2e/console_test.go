package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/sandbox"
	"github.com/idemhq/idem/internal/testenv"
)

// TestTheConsoleShowsWhatIsWrongAndFixesIt is issue 36's acceptance, as an
// operator would use the console: a real `idem consume` and `idem relay`,
// and a seeded mess — dead letters of four reasons (a poisoned handler, an
// undecodable body, a payload conflict, a body cut for its size), three
// dead outbox rows, and a kill switch tripped by a missing table — driven in
// headless Chromium. From the pages alone: the fleet names the tripped
// switch and its error, and shows the consumer ready once the table is
// back; the handler's dead letters are replayed once it is fixed and
// applied once each; the cut letter's replay is refused and it stays; the
// undecodable one is purged; the dead outbox rows are replayed and reach
// their queue; one event is looked up. Screenshots of each page go to
// $CONSOLE_SHOTS when set (make console-shots: docs/console).
func TestTheConsoleShowsWhatIsWrongAndFixesIt(t *testing.T) {
	t.Parallel()
	browser := startBrowser(t)
	e := newEnv(t, "", "")
	ctx := context.Background()
	e.vars = append(e.vars, "IDEM_CONSUMER_DELIVERY_LIMIT=2", "IDEM_CONSUMER_MAX_BODY_BYTES=1024", "IDEM_HEARTBEAT=300ms",
		"IDEM_CONSUMER_KILL_SWITCH_PROBE_MIN=200ms", "IDEM_CONSUMER_KILL_SWITCH_PROBE_MAX=1s")
	auditQ := e.queue + ".audit"
	t.Cleanup(func() { _ = sandbox.DeleteQueue(e.amqpURL, auditQ) })
	_, err := e.channel().QueueDeclare(auditQ, true, false, false, false, amqp.Table{"x-queue-type": "quorum"})
	require.NoError(t, err)
	e.poisonLedger()
	c0 := e.consume("c0")
	e.waitConsuming(c0)
	e.relay("r0", "IDEM_OUTBOX_DESTINATIONS=audit=queue:"+auditQ)

	// The mess.
	pay := func(id, user, amount string) amqp.Publishing {
		return body(`{"eventId":"` + id + `","userId":"` + user + `","type":"PAYMENT_COMPLETED","amount":` + amount + `}`)
	}
	e.publishRaw(pay("evt_a", "user_1", "100"))
	e.waitRows(1)
	e.publishRaw(
		body(`{"eventId":`),              // invalid_json
		pay("evt_a", "user_1", "999"),    // payload_conflict
		pay("evt_p", "user_poison", "7"), // handler_failed
		pay("evt_q", "user_poison", "5"), // handler_failed
		body(`{"eventId":"evt_big","userId":"user_1","type":"PAYMENT_COMPLETED","amount":1,"note":"`+strings.Repeat("x", 3000)+`"}`), // body_too_large
	)
	dlqDepth := func() int { return testenv.QueueDepth(t, e.amqpURL, e.queue+".dlq") }
	require.Eventually(t, func() bool { return dlqDepth() == 5 }, 60*time.Second, 20*time.Millisecond, "the seeded dead letters")
	for i := range 3 {
		_, err := e.pool.Exec(ctx, `INSERT INTO idem_outbox (scope, event_id, idx, destination, lane, type, body, state, attempts, last_error)
			VALUES ('pay', $1, 0, 'audit', 0, 'AUDIT', '{}', 'dead', 20, 'amqp: queue not found (a queue deleted)')`, fmt.Sprintf("evt_o%d", i))
		require.NoError(t, err)
	}
	_, err = e.pool.Exec(ctx, `ALTER TABLE payments_ledger RENAME TO payments_ledger_away`)
	require.NoError(t, err)
	m := e.publish(40, 0)

	// The console, with a token.
	const token = "console-token-0123456789"
	addr := fmt.Sprintf("127.0.0.1:%d", testenv.FreePort(t))
	cctx, stop := context.WithCancel(ctx)
	cmd, out := e.command(cctx, []string{"IDEM_CONSOLE_TOKEN=" + token}, "console", "--addr", addr)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		stop()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("--- idem console:\n%s", out.String())
		}
	})
	base := "http://" + addr
	require.Eventually(t, func() bool {
		resp, err := http.Get(base + "/login")
		if err == nil {
			resp.Body.Close()
		}
		return err == nil
	}, 30*time.Second, 50*time.Millisecond, "the console never answered")

	// step runs browser actions bounded by a minute.
	step := func(what string, actions ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		sctx, cancel := context.WithTimeout(browser, time.Minute)
		defer cancel()
		require.NoError(t, chromedp.Do(sctx, actions...), what)
	}
	text := func(sel string) string {
		t.Helper()
		sctx, cancel := context.WithTimeout(browser, time.Minute)
		defer cancel()
		s, err := chromedp.Run(sctx, chromedp.Text(chromedp.CSS(sel)))
		require.NoError(t, err, sel)
		return s
	}
	// pageShows reloads path until sel's text holds every want.
	pageShows := func(path, sel string, want ...string) string {
		t.Helper()
		var last string
		require.Eventually(t, func() bool {
			step("open "+path, chromedp.Navigate(base+path))
			last = text(sel)
			for _, w := range want {
				if !strings.Contains(last, w) {
					return false
				}
			}
			return true
		}, 60*time.Second, 300*time.Millisecond, "%s never showed %q in %s; last:\n%s", path, want, sel, last)
		return last
	}
	shot := func(name string) {
		t.Helper()
		dir := os.Getenv("CONSOLE_SHOTS")
		if dir == "" {
			return
		}
		sctx, cancel := context.WithTimeout(browser, time.Minute)
		defer cancel()
		png, err := chromedp.Run(sctx, chromedp.FullScreenshot(100))
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(dir, name+".png"), png, 0o644))
	}
	// act opens path afresh (no flash left from before), clicks, and
	// returns the flash the action's page shows.
	act := func(path string, clicks ...string) string {
		t.Helper()
		step("open "+path, chromedp.Navigate(base+path))
		for _, c := range clicks {
			step("click "+c, chromedp.Click(chromedp.CSS(c)))
		}
		return text("#flash")
	}

	// Not signed in, the page offers no action; signed in, it does.
	step("sign in", chromedp.Navigate(base+"/login"), chromedp.SendKeys(chromedp.CSS("#token"), token), chromedp.Click(chromedp.CSS("#signin")),
		chromedp.WaitVisible(chromedp.CSS("#who")))
	require.Equal(t, "token", text("#who"))

	// 1. The fleet names the tripped switch and its error.
	fleet := pageShows("/", "#instances", "kill switch tripped on 42P01", `relation "payments_ledger" does not exist`, "relay")
	require.Contains(t, fleet, "c0")
	shot("fleet")
	// The deploy is fixed: the consumer is ready again, by itself.
	_, err = e.pool.Exec(ctx, `ALTER TABLE payments_ledger_away RENAME TO payments_ledger`)
	require.NoError(t, err)
	pageShows("/", "#instances", "ready")
	require.Eventually(t, func() bool {
		step("open /", chromedp.Navigate(base+"/"))
		return !strings.Contains(text("#instances"), "kill switch")
	}, 60*time.Second, 300*time.Millisecond, "the switch never showed closed")

	// 2. The dead letters, grouped.
	dl := pageShows("/dlq", "main", "handler_failed · PAYMENT_COMPLETED", "invalid_json · (none)", "payload_conflict · PAYMENT_COMPLETED",
		"body_too_large · (none)", "poisoned payment", "original: processed")
	require.NotContains(t, dl, "<script")
	shot("dlq")
	// The handler is fixed; its letters (and any the missing table
	// dead-lettered before the switch tripped: a handful at most) are
	// replayed from their groups.
	_, err = e.pool.Exec(ctx, `DROP TRIGGER poison ON payments_ledger`)
	require.NoError(t, err)
	sctx, cancel := context.WithTimeout(browser, time.Minute)
	groups, err := chromedp.Run(sctx, chromedp.AttributesAll(chromedp.CSS("section.group")))
	cancel()
	require.NoError(t, err)
	replayed := 0
	for _, g := range groups {
		switch g["data-reason"] {
		case "invalid_json", "payload_conflict", "body_too_large":
			continue
		}
		flash := act("/dlq", fmt.Sprintf(`section[data-reason=%q] button.replay-group`, g["data-reason"]))
		require.Contains(t, flash, "dlq replay (reason")
		require.Regexp(t, `: [1-9]\d* done`, flash)
		replayed++
	}
	require.Positive(t, replayed)
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, e.pool.QueryRow(ctx, `SELECT count(*) FROM payments_ledger WHERE event_id IN ('evt_p', 'evt_q')`).Scan(&n))
		return n == 2
	}, 60*time.Second, 50*time.Millisecond, "the replayed letters were never applied")
	// A cut letter's replay is refused, as idem dlq replay refuses it.
	flash := act("/dlq", `section[data-reason="body_too_large"] button.replay-group`)
	require.Contains(t, flash, "0 done, 1 refused")
	require.Contains(t, flash, "carry only the first bytes")
	// The undecodable one is purged, once confirmed.
	flash = act("/dlq", `section[data-reason="invalid_json"] input[name=confirm]`, `section[data-reason="invalid_json"] button.purge-group`)
	require.Contains(t, flash, "dlq purge")
	require.Contains(t, flash, "1 done")
	require.Eventually(t, func() bool { return dlqDepth() == 2 }, 30*time.Second, 20*time.Millisecond,
		"the conflict and the cut letter stay")
	dl = pageShows("/dlq", "main", "payload_conflict", "body_too_large")
	require.NotContains(t, dl, "handler_failed")
	require.NotContains(t, dl, "invalid_json")

	// 3. The outbox: the dead rows of audit, replayed; the relay sends them.
	pageShows("/outbox", "#destinations", "audit")
	require.Contains(t, text("#dead"), "queue not found")
	shot("outbox")
	flash = act("/outbox", "button.replay-dest")
	require.Contains(t, flash, `outbox replay (destination "audit"): 3 done`)
	require.Eventually(t, func() bool { return e.outboxStates()["sent"] == 3 }, 60*time.Second, 50*time.Millisecond, "never sent")
	require.Eventually(t, func() bool { return testenv.QueueDepth(t, e.amqpURL, auditQ) == 3 }, 30*time.Second, 20*time.Millisecond)
	pageShows("/outbox", "#destinations", "No pending or dead row")

	// 4. One event.
	step("look up", chromedp.Navigate(base+"/event"), chromedp.SendKeys(chromedp.CSS("#event-id"), "evt_p"), chromedp.Submit(chromedp.CSS("#event-id")),
		chromedp.WaitVisible(chromedp.CSS("#inspect")))
	ev := text("#inspect")
	require.Contains(t, ev, "evt_p")
	require.Regexp(t, `dedup row:\s+processed`, ev)
	shot("event")

	// Every event of the stream once; the actions logged with who did them.
	e.waitApplied(m)
	e.stopAll()
	e.requireExactlyOnce(m)
	stop()
	_ = cmd.Wait()
	require.Contains(t, out.String(), `msg="console action" who=token action="dlq replay"`)
	require.Contains(t, out.String(), `action="outbox replay" selection="destination \"audit\"" done=3`)
}
