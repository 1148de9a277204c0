package console

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/heartbeat"
)

// fake is a Backend that records the actions it is asked for.
type fake struct {
	mu      sync.Mutex
	actions []string
}

func (f *fake) record(s string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.actions = append(f.actions, s)
}

func (f *fake) done() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.actions...)
}

func (f *fake) Fleet(context.Context) (Fleet, error) {
	now := time.Now()
	return Fleet{Now: now, Instances: []heartbeat.Report{
		{Instance: "c0@h:1", Kind: "consumer", Scope: "pay", Queue: "q", SeenAt: now, Every: time.Second, Ready: false,
			Why: "consumer: failing: kill switch open", TrippedOn: "42P01", Counts: map[string]int64{"processed": 3}, Rates: map[string]float64{"processed": 1.5}},
		{Instance: "c1@h:2", Kind: "consumer", SeenAt: now.Add(-time.Minute), Every: time.Second, Ready: true},
	}}, nil
}

func (f *fake) DeadLetters(context.Context) (DeadLetters, error) {
	return DeadLetters{Queue: "q.dlq", Total: 2, Groups: []Group{{Reason: "invalid_json", Type: "(none)", Count: 2,
		Letters: []Letter{{Key: "dl:1", Body: `<script>alert(1)</script>`, Error: "bad"}, {Key: "dl:2", Cut: true, Body: "cut"}}}}}, nil
}

func (f *fake) ReplayLetters(_ context.Context, sel Selection) (Result, error) {
	f.record(fmt.Sprintf("replay %s/%s %s max %d", sel.Reason, sel.Type, strings.Join(sel.Keys, ","), sel.Max))
	return Result{Done: 1, Refused: 1}, nil
}

func (f *fake) PurgeLetters(_ context.Context, sel Selection) (Result, error) {
	f.record(fmt.Sprintf("purge %s/%s %s max %d", sel.Reason, sel.Type, strings.Join(sel.Keys, ","), sel.Max))
	return Result{Done: 2}, nil
}

func (f *fake) Outbox(context.Context) (Outbox, error) {
	return Outbox{Destinations: []Destination{{Name: "audit", Dead: 1}}, Dead: []Row{{ID: "7", Destination: "audit", LastError: "http 401"}}}, nil
}

func (f *fake) ReplayOutbox(_ context.Context, dest string, ids []string) (Result, error) {
	f.record("outbox " + dest + " " + strings.Join(ids, ","))
	return Result{Done: 1}, nil
}

func (f *fake) Inspect(_ context.Context, id string) (string, error) { return "event:\t" + id, nil }

// client is a browser without a browser: cookies, and the CSRF token of
// the last page it read.
type client struct {
	t    *testing.T
	base string
	c    *http.Client
	csrf string
}

func newClient(t *testing.T, h http.Handler) *client {
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	jar, _ := cookiejar.New(nil)
	return &client{t: t, base: srv.URL, c: &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error {
		return http.ErrUseLastResponse
	}}}
}

var csrfField = regexp.MustCompile(`name="csrf" value="([0-9a-f]{64})"`)

func (c *client) get(path string, header ...string) (int, string) {
	c.t.Helper()
	req, _ := http.NewRequest("GET", c.base+path, nil)
	for i := 0; i+1 < len(header); i += 2 {
		if header[i] == "Host" {
			req.Host = header[i+1]
		}
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := c.c.Do(req)
	require.NoError(c.t, err)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if m := csrfField.FindStringSubmatch(string(b)); m != nil {
		c.csrf = m[1]
	}
	return resp.StatusCode, string(b)
}

func (c *client) post(path string, form url.Values, header ...string) (int, string) {
	c.t.Helper()
	req, _ := http.NewRequest("POST", c.base+path, strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := c.c.Do(req)
	require.NoError(c.t, err)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode == http.StatusSeeOther {
		return resp.StatusCode, resp.Header.Get("Location")
	}
	return resp.StatusCode, string(b)
}

const token = "0123456789abcdef-token"

func newServer(t *testing.T, o Options) (*fake, *client, *bytes.Buffer) {
	var logs bytes.Buffer
	o.Log = slog.New(slog.NewTextHandler(&logs, nil))
	f := &fake{}
	s, err := New(f, o)
	require.NoError(t, err)
	return f, newClient(t, s), &logs
}

// TestActionsNeedAnIdentityAndTheFormsToken: every state-changing request
// is a POST with the CSRF token of a page the same browser read, by someone
// signed in (or named by the proxy's header); each is logged with who,
// what and how many. A read needs nothing.
func TestActionsNeedAnIdentityAndTheFormsToken(t *testing.T) {
	f, c, logs := newServer(t, Options{Token: token})
	code, body := c.get("/dlq")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "sign in to act")
	require.NotContains(t, body, "Replay these", "no action is offered to nobody")
	group := url.Values{"group": {"1"}, "reason": {"invalid_json"}, "type": {"(none)"}, "shown": {"2"}, "newest": {"0"}}

	// Not signed in: refused, even with the token of the form.
	group.Set("csrf", c.csrf)
	code, body = c.post("/dlq/replay", group)
	require.Equal(t, http.StatusForbidden, code, body)
	// A GET never acts.
	code, _ = c.get("/dlq/replay")
	require.Equal(t, http.StatusMethodNotAllowed, code)

	// A wrong token does not sign in.
	c.get("/login")
	code, loc := c.post("/login", url.Values{"csrf": {c.csrf}, "token": {"wrong"}})
	require.Equal(t, http.StatusSeeOther, code)
	require.Contains(t, loc, "failed=wrong+token")
	code, loc = c.post("/login", url.Values{"csrf": {c.csrf}, "token": {token}})
	require.Equal(t, http.StatusSeeOther, code)
	require.Equal(t, "/", loc)
	_, body = c.get("/dlq")
	require.Contains(t, body, "Replay these 2")

	// Signed in, but without the form's token, or with another's, or from
	// another origin: refused.
	group.Del("csrf")
	code, _ = c.post("/dlq/replay", group)
	require.Equal(t, http.StatusForbidden, code)
	group.Set("csrf", strings.Repeat("0", 64))
	code, _ = c.post("/dlq/replay", group)
	require.Equal(t, http.StatusForbidden, code)
	group.Set("csrf", c.csrf)
	code, _ = c.post("/dlq/replay", group, "Origin", "https://evil.example")
	require.Equal(t, http.StatusForbidden, code)
	require.Empty(t, f.done(), "nothing was done")

	code, loc = c.post("/dlq/replay", group)
	require.Equal(t, http.StatusSeeOther, code)
	require.Contains(t, loc, "/dlq?done=")
	require.Equal(t, []string{"replay invalid_json/(none)  max 2"}, f.done())
	_, body = c.get(loc)
	require.Contains(t, body, `dlq replay (reason &#34;invalid_json&#34;, type &#34;(none)&#34;, the 2 shown): 1 done, 1 refused`)
	require.Contains(t, logs.String(), `msg="console action" who=token action="dlq replay"`)
	require.Contains(t, logs.String(), "done=1 refused=1")

	// A selection; a purge needs its confirmation.
	code, _ = c.post("/dlq/replay", url.Values{"csrf": {c.csrf}, "key": {"dl:1"}})
	require.Equal(t, http.StatusSeeOther, code)
	code, loc = c.post("/dlq/purge", url.Values{"csrf": {c.csrf}, "key": {"dl:1", "dl:2"}})
	require.Equal(t, http.StatusSeeOther, code)
	require.Contains(t, loc, "failed=")
	code, _ = c.post("/dlq/purge", url.Values{"csrf": {c.csrf}, "key": {"dl:1", "dl:2"}, "confirm": {"yes"}})
	require.Equal(t, http.StatusSeeOther, code)
	code, _ = c.post("/outbox/replay", url.Values{"csrf": {c.csrf}, "destination": {"audit"}})
	require.Equal(t, http.StatusSeeOther, code)
	code, loc = c.post("/outbox/replay", url.Values{"csrf": {c.csrf}})
	require.Equal(t, http.StatusSeeOther, code)
	require.Contains(t, loc, "failed=")
	require.Equal(t, []string{"replay invalid_json/(none)  max 2", "replay / dl:1 max 1", "purge / dl:1,dl:2 max 2", "outbox audit "}, f.done())

	// A group's action without what the page showed is refused: it
	// would take letters that arrived since.
	code, loc = c.post("/dlq/purge", url.Values{"csrf": {c.csrf}, "group": {"1"}, "reason": {"x"}, "confirm": {"yes"}})
	require.Equal(t, http.StatusSeeOther, code)
	require.Contains(t, loc, "failed=")
	require.Len(t, f.done(), 4)

	// Signed out: refused again, and a copy of the session's cookie too.
	u, _ := url.Parse(c.base)
	var session *http.Cookie
	for _, k := range c.c.Jar.Cookies(u) {
		if k.Name == sessionCookie {
			session = k
		}
	}
	require.NotNil(t, session)
	code, _ = c.post("/logout", url.Values{"csrf": {c.csrf}})
	require.Equal(t, http.StatusSeeOther, code)
	code, _ = c.post("/dlq/replay", group)
	require.Equal(t, http.StatusForbidden, code)
	c.c.Jar.SetCookies(u, []*http.Cookie{session})
	code, _ = c.post("/dlq/replay", group)
	require.Equal(t, http.StatusForbidden, code, "a signed-out session's cookie, replayed")
	require.Len(t, f.done(), 4)
}

// TestAnotherSiteCannotReadOrAct: a Host the console does not answer for
// (a name re-pointed at it: DNS rebinding) gets no page; an Origin of
// another site, a null one, a browser's cross-site mark, or a CSRF cookie
// another site set with a token of its own are refused; a banner is shown
// only as the console signed it.
func TestAnotherSiteCannotReadOrAct(t *testing.T) {
	f, c, _ := newServer(t, Options{TrustedHeader: "X-User", Hosts: []string{"console.example"}})
	code, _ := c.get("/dlq", "Host", "attacker.example:8089")
	require.Equal(t, http.StatusMisdirectedRequest, code)
	code, _ = c.get("/dlq", "Host", "console.example")
	require.Equal(t, http.StatusOK, code)
	code, _ = c.get("/login", "Host", "localhost:8089")
	require.Equal(t, http.StatusOK, code)
	code, _ = c.get("/dlq", "X-User", "alice")
	require.Equal(t, http.StatusOK, code)
	form := url.Values{"csrf": {c.csrf}, "key": {"k"}}
	for _, h := range [][]string{
		{"Origin", "https://attacker.example"},
		{"Origin", "null"},
		{"Sec-Fetch-Site", "cross-site"},
	} {
		code, _ = c.post("/dlq/replay", form, "X-User", "alice", h[0], h[1])
		require.Equal(t, http.StatusForbidden, code, h)
	}
	code, body := c.post("/dlq/replay", form, "X-User", "alice", "Origin", "https://console.example")
	require.Equal(t, http.StatusSeeOther, code, "the proxy's name is this console's origin: %s", body)
	require.Len(t, f.done(), 1)

	// A tossed cookie: a value of the attacker's, and the same value as
	// the form's token.
	u, _ := url.Parse(c.base)
	tossed := strings.Repeat("ab", 32)
	c.c.Jar.SetCookies(u, []*http.Cookie{{Name: csrfCookie, Value: tossed, Path: "/"}})
	code, _ = c.post("/dlq/replay", url.Values{"csrf": {tossed}, "key": {"k"}}, "X-User", "alice")
	require.Equal(t, http.StatusForbidden, code)
	// Two values of the trusted header (a proxy that appends): nobody.
	req, _ := http.NewRequest("POST", c.base+"/dlq/replay", strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Add("X-User", "mallory")
	req.Header.Add("X-User", "alice")
	resp, err := c.c.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusForbidden, resp.StatusCode)
	require.Len(t, f.done(), 1)

	_, body = c.get("/dlq?done=" + url.QueryEscape("session expired: sign in at https://evil.example"))
	require.NotContains(t, body, "evil.example")
	_, body = c.get("/dlq?done=x&sig=" + strings.Repeat("0", 64))
	require.NotContains(t, body, `id="flash"`)
}

// TestATrustedHeaderActsAsItsUser: behind a proxy, the header names who
// acts; without it, nobody may.
func TestATrustedHeaderActsAsItsUser(t *testing.T) {
	f, c, logs := newServer(t, Options{TrustedHeader: "X-Forwarded-User"})
	_, body := c.get("/outbox", "X-Forwarded-User", "alice")
	require.Contains(t, body, `acting as <b id="who">alice</b>`)
	form := url.Values{"csrf": {c.csrf}, "id": {"7"}}
	code, _ := c.post("/outbox/replay", form)
	require.Equal(t, http.StatusForbidden, code, "no header: nobody")
	code, _ = c.post("/outbox/replay", form, "X-Forwarded-User", "alice")
	require.Equal(t, http.StatusSeeOther, code)
	require.Equal(t, []string{"outbox  7"}, f.done())
	require.Contains(t, logs.String(), "who=alice action=\"outbox replay\"")
}

// TestATrustedHeaderFromAnotherAddressIsNobody: with TrustedProxies, the
// header is believed only from the proxy's network.
func TestATrustedHeaderFromAnotherAddressIsNobody(t *testing.T) {
	_, proxy, _ := net.ParseCIDR("10.0.0.0/8")
	f, c, _ := newServer(t, Options{TrustedHeader: "X-User", TrustedProxies: []*net.IPNet{proxy}})
	_, body := c.get("/outbox", "X-User", "alice")
	require.NotContains(t, body, "alice", "the test's client is 127.0.0.1, not the proxy")
	c.get("/login")
	code, _ := c.post("/outbox/replay", url.Values{"csrf": {c.csrf}, "id": {"7"}}, "X-User", "alice")
	require.Equal(t, http.StatusForbidden, code)
	require.Empty(t, f.done())
	_, local, _ := net.ParseCIDR("127.0.0.0/8")
	_, c, _ = newServer(t, Options{TrustedHeader: "X-User", TrustedProxies: []*net.IPNet{local}})
	_, body = c.get("/outbox", "X-User", "alice")
	require.Contains(t, body, `acting as <b id="who">alice</b>`)
}

// TestReadOnlyRefusesEveryAction, whoever asks, and offers none.
func TestReadOnlyRefusesEveryAction(t *testing.T) {
	f, c, _ := newServer(t, Options{Token: token, TrustedHeader: "X-User", ReadOnly: true})
	_, body := c.get("/dlq", "X-User", "alice")
	require.Contains(t, body, "read-only")
	require.NotContains(t, body, "Replay these")
	for _, path := range []string{"/dlq/replay", "/dlq/purge", "/outbox/replay"} {
		code, _ := c.post(path, url.Values{"csrf": {c.csrf}, "group": {"1"}, "reason": {"x"}, "key": {"k"}, "destination": {"d"}, "confirm": {"yes"}}, "X-User", "alice")
		require.Equal(t, http.StatusForbidden, code, path)
	}
	require.Empty(t, f.done())
}

// TestNoTokenNoHeaderNoActions: a console started with neither says how
// to open actions and takes none.
func TestNoTokenNoHeaderNoActions(t *testing.T) {
	f, c, _ := newServer(t, Options{})
	_, body := c.get("/dlq")
	require.Contains(t, body, "actions need a token (IDEM_CONSOLE_TOKEN)")
	code, _ := c.post("/login", url.Values{"csrf": {c.csrf}, "token": {""}})
	require.Equal(t, http.StatusSeeOther, code)
	code, _ = c.post("/dlq/replay", url.Values{"csrf": {c.csrf}, "key": {"k"}})
	require.Equal(t, http.StatusForbidden, code)
	require.Empty(t, f.done())
}

// TestPagesAreInert: a producer's text is escaped, the page runs no
// script (its policy allows none), and the fleet says what is wrong.
func TestPagesAreInert(t *testing.T) {
	_, c, _ := newServer(t, Options{Token: token})
	req, _ := http.NewRequest("GET", c.base+"/dlq", nil)
	resp, err := c.c.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Contains(t, resp.Header.Get("Content-Security-Policy"), "default-src 'none'")
	require.Equal(t, "nosniff", resp.Header.Get("X-Content-Type-Options"))
	// Not no-referrer: a browser would send the forms with "Origin: null".
	require.Equal(t, "same-origin", resp.Header.Get("Referrer-Policy"))
	_, body := c.get("/dlq")
	require.NotContains(t, body, "<script>")
	require.Contains(t, body, "&lt;script&gt;alert(1)&lt;/script&gt;")

	_, body = c.get("/")
	require.Contains(t, body, "kill switch tripped on 42P01")
	require.Contains(t, body, "consumer: failing: kill switch open")
	require.Regexp(t, `silent for 1m0\.\ds|silent for 1m\ds|silent for 1m0s`, body, "a report a minute old")
	_, body = c.get("/event?id=evt_1")
	require.Contains(t, body, "event:\tevt_1")
	_, body = c.get("/event?id=" + url.QueryEscape("bad id\x00"))
	require.Contains(t, body, `class="fail"`)
}
