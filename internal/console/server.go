package console

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/idemhq/idem/internal/heartbeat"
	"github.com/idemhq/idem/pkg/guard"
)

//go:embed templates/*.html static/*
var assets embed.FS

// Options are how the console guards its actions.
type Options struct {
	// Token, if set, is the secret an operator gives on the login page to
	// act; the session it opens lasts 12 hours (a cookie, HttpOnly,
	// SameSite=Strict). Compared in constant time.
	Token string
	// TrustedHeader, if set, names a header a reverse proxy in front of
	// the console sets to the signed-in user (X-Forwarded-User, say): a
	// request carrying it may act, as that user. Only behind a proxy that
	// sets it on every request and strips it from clients'.
	TrustedHeader string
	// TrustedProxies, if set, are the networks the trusted header is
	// believed from: a request from any other address carrying it acts as
	// nobody.
	TrustedProxies []*net.IPNet
	// ReadOnly refuses every action, whoever asks.
	ReadOnly bool
	// PrometheusURL, if set, is linked from the fleet page.
	PrometheusURL string
	// Services names what the console looks at (scope, queue, database
	// host), shown in the page's header.
	Services string
	// Hosts are the host names (without port) the console answers to
	// besides loopback ones (localhost, 127.0.0.1, ::1): the name a
	// reverse proxy forwards, or the address it listens on beyond
	// loopback. A request for any other Host is refused, so that a web
	// page whose name was re-pointed at the console (DNS rebinding)
	// cannot read it; an action's Origin must name one of them too.
	Hosts []string
	// Mask hides secrets in the texts the page shows (errors); nil shows
	// them as they are.
	Mask func(string) string
	// Log receives each action: who, what, and how many.
	Log *slog.Logger
}

// Server is the console's http.Handler.
type Server struct {
	b      Backend
	o      Options
	pages  map[string]*template.Template
	secret []byte // signs sessions, CSRF tokens and flashes; new each start, so a restart signs everyone out
	mux    *http.ServeMux

	mu      sync.Mutex
	revoked map[string]time.Time // signed-out sessions' nonces, until they expire
}

// sessionTTL is how long a login lasts.
const sessionTTL = 12 * time.Hour

// New returns the console over b.
func New(b Backend, o Options) (*Server, error) {
	if o.Log == nil {
		o.Log = slog.Default()
	}
	if o.Mask == nil {
		o.Mask = func(s string) string { return s }
	}
	s := &Server{b: b, o: o, pages: map[string]*template.Template{}, secret: make([]byte, 32), mux: http.NewServeMux(),
		revoked: map[string]time.Time{}}
	if _, err := rand.Read(s.secret); err != nil {
		return nil, err
	}
	for _, p := range []string{"fleet", "dlq", "outbox", "event", "login"} {
		t, err := template.New("layout.html").Funcs(funcs).ParseFS(assets, "templates/layout.html", "templates/"+p+".html")
		if err != nil {
			return nil, fmt.Errorf("console: template %s: %w", p, err)
		}
		s.pages[p] = t
	}
	static, err := fs.Sub(assets, "static")
	if err != nil {
		return nil, err
	}
	s.mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	s.mux.HandleFunc("GET /{$}", s.fleet)
	s.mux.HandleFunc("GET /dlq", s.deadLetters)
	s.mux.HandleFunc("POST /dlq/replay", s.act("dlq replay", s.replayLetters))
	s.mux.HandleFunc("POST /dlq/purge", s.act("dlq purge", s.purgeLetters))
	s.mux.HandleFunc("GET /outbox", s.outbox)
	s.mux.HandleFunc("POST /outbox/replay", s.act("outbox replay", s.replayOutbox))
	s.mux.HandleFunc("GET /event", s.event)
	s.mux.HandleFunc("GET /login", s.loginPage)
	s.mux.HandleFunc("POST /login", s.login)
	s.mux.HandleFunc("POST /logout", s.logout)
	return s, nil
}

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if host := hostOf(r.Host); !s.allowedHost(host) {
		http.Error(w, fmt.Sprintf("this console does not answer for host %q (start it with --public-host %s if that is its name)", host, host), http.StatusMisdirectedRequest)
		return
	}
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	// same-origin, not no-referrer: under no-referrer a browser sends
	// "Origin: null" with the page's own forms, which checkPost refuses.
	h.Set("Referrer-Policy", "same-origin")
	h.Set("Cache-Control", "no-store")
	s.mux.ServeHTTP(w, r)
}

// hostOf is a Host header's or an origin's host name, without its port.
func hostOf(hostport string) string {
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		return strings.ToLower(h)
	}
	return strings.ToLower(strings.Trim(hostport, "[]"))
}

// allowedHost reports whether the console answers for host: a loopback
// name, or one of Options.Hosts.
func (s *Server) allowedHost(host string) bool {
	if host == "localhost" {
		return true
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() {
		return true
	}
	for _, h := range s.o.Hosts {
		if strings.EqualFold(h, host) {
			return true
		}
	}
	return false
}

var funcs = template.FuncMap{
	"ago": func(now, t time.Time) string {
		if t.IsZero() {
			return "?"
		}
		return roundAge(now.Sub(t))
	},
	"dur": roundAge,
	"until": func(t time.Time) string {
		if d := time.Until(t); d > 0 {
			return "in " + roundAge(d)
		}
		return "due"
	},
	"silent": func(r heartbeat.Report, now time.Time) string {
		if d := r.Silent(now); d > 0 {
			return roundAge(d)
		}
		return ""
	},
	"rate": func(m map[string]float64, k string) string {
		if v, ok := m[k]; ok {
			return fmt.Sprintf("%.1f", v)
		}
		return "–"
	},
	"count": func(m map[string]int64, k string) int64 { return m[k] },
	"lines": func(s string) []string { return strings.Split(s, "\n") },
	"nanos": func(t time.Time) int64 {
		if t.IsZero() {
			return 0
		}
		return t.UnixNano()
	},
}

func roundAge(d time.Duration) string {
	switch {
	case d < 0:
		return "0s"
	case d < time.Minute:
		return d.Round(100 * time.Millisecond).String()
	case d < 48*time.Hour:
		return d.Round(time.Second).String()
	}
	return fmt.Sprintf("%dd", int(d/(24*time.Hour)))
}

// page is what every template gets.
type page struct {
	Title, Nav  string
	Who         string // who may act; empty: nobody yet
	CanAct      bool   // an action would be taken
	ActNote     string // why not, when not
	CSRF        string
	Services    string
	Prometheus  string
	Flash, Fail string
	Now         time.Time
	Data        any
}

func (s *Server) render(w http.ResponseWriter, r *http.Request, name, title string, data any, fail error) {
	p := page{Title: title, Nav: name, Services: s.o.Services, Prometheus: s.o.PrometheusURL, Now: time.Now(), Data: data,
		CSRF: s.csrf(w, r)}
	p.Who = s.who(r)
	p.CanAct, p.ActNote = s.canAct(p.Who)
	// A flash is shown only as this console signed it: a link cannot put
	// words of its own in the page's banners.
	q := r.URL.Query()
	if sig := q.Get("sig"); sig != "" {
		done, failed := q.Get("done"), q.Get("failed")
		if hmac.Equal([]byte(sig), []byte(s.sign("flash", done+"\x00"+failed))) {
			p.Flash, p.Fail = done, failed
		}
	}
	if fail != nil {
		p.Fail = s.o.Mask(fail.Error())
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	if err := s.pages[name].Execute(w, p); err != nil {
		s.o.Log.Error("console: render", "page", name, "err", err)
	}
}

// canAct says whether actions are open to who, and if not, why.
func (s *Server) canAct(who string) (bool, string) {
	switch {
	case s.o.ReadOnly:
		return false, "this console is read-only (--read-only)"
	case s.o.Token == "" && s.o.TrustedHeader == "":
		return false, "actions need a token (IDEM_CONSOLE_TOKEN) or a trusted header from a reverse proxy (--trusted-header); this console has neither"
	case who == "":
		return false, "sign in to act"
	}
	return true, ""
}

// who is who the request acts as: the trusted header's user, "token" for a
// valid session; empty for nobody.
func (s *Server) who(r *http.Request) string {
	if h := s.o.TrustedHeader; h != "" && s.fromProxy(r) {
		// One value, set by the proxy: a client's own copy beside the
		// proxy's (a proxy that appends) names nobody.
		if vs := r.Header.Values(h); len(vs) == 1 {
			if u := strings.TrimSpace(vs[0]); u != "" {
				return u
			}
		} else if len(vs) > 1 {
			return ""
		}
	}
	if s.o.Token == "" {
		return ""
	}
	c, err := r.Cookie(sessionCookie)
	if err != nil {
		return ""
	}
	exp, nonce, ok := s.session(c.Value)
	if !ok || time.Now().After(exp) {
		return ""
	}
	s.mu.Lock()
	_, out := s.revoked[nonce]
	s.mu.Unlock()
	if out {
		return ""
	}
	return "token"
}

// fromProxy reports whether r comes from a trusted proxy's address (any
// address when none is configured).
func (s *Server) fromProxy(r *http.Request) bool {
	if len(s.o.TrustedProxies) == 0 {
		return true
	}
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	ip := net.ParseIP(host)
	if err != nil || ip == nil {
		return false
	}
	for _, n := range s.o.TrustedProxies {
		if n.Contains(ip) {
			return true
		}
	}
	return false
}

// session reads a session cookie's value: exp.nonce.mac.
func (s *Server) session(v string) (exp time.Time, nonce string, ok bool) {
	parts := strings.Split(v, ".")
	if len(parts) != 3 || !hmac.Equal([]byte(parts[2]), []byte(s.sign("session", parts[0]+"."+parts[1]))) {
		return exp, "", false
	}
	exp, err := time.Parse(time.RFC3339, parts[0])
	return exp, parts[1], err == nil
}

// secure says whether the browser reached the console over TLS (itself,
// or a proxy in front that says so): then cookies are Secure.
func secure(r *http.Request) bool {
	return r.TLS != nil || r.Header.Get("X-Forwarded-Proto") == "https"
}

const (
	sessionCookie = "idem_console_session"
	csrfCookie    = "idem_console_csrf"
)

func (s *Server) sign(kind, v string) string {
	m := hmac.New(sha256.New, s.secret)
	m.Write([]byte(kind + ":" + v))
	return hex.EncodeToString(m.Sum(nil))
}

// csrf returns the request's CSRF token, setting the cookie it is derived
// from if the browser has none: the form's token is the cookie's value
// signed with the console's secret, so a cookie another site manages to
// set (a sibling subdomain) comes with no token that matches it.
func (s *Server) csrf(w http.ResponseWriter, r *http.Request) string {
	if c, err := r.Cookie(csrfCookie); err == nil && len(c.Value) == 64 {
		return s.sign("csrf", c.Value)
	}
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	v := hex.EncodeToString(b)
	http.SetCookie(w, &http.Cookie{Name: csrfCookie, Value: v, Path: "/", HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: secure(r)})
	return s.sign("csrf", v)
}

// checkPost refuses a state-changing request without the form's CSRF token
// matching its cookie, or from another origin.
func (s *Server) checkPost(r *http.Request) error {
	if o := r.Header.Get("Origin"); o != "" {
		u, err := url.Parse(o)
		if err != nil || o == "null" || !s.allowedHost(hostOf(u.Host)) {
			return fmt.Errorf("refused: the request comes from another origin (%s)", o)
		}
	}
	if r.Header.Get("Sec-Fetch-Site") == "cross-site" {
		return fmt.Errorf("refused: the browser says the request comes from another site")
	}
	c, err := r.Cookie(csrfCookie)
	if err != nil || c.Value == "" || subtle.ConstantTimeCompare([]byte(s.sign("csrf", c.Value)), []byte(r.PostFormValue("csrf"))) != 1 {
		return fmt.Errorf("refused: the form's CSRF token is missing or stale; reload the page and try again")
	}
	return nil
}

// act wraps an action: POST with a valid CSRF token, by someone who may
// act, logged with who, what and how many; then back to the page.
func (s *Server) act(what string, do func(r *http.Request) (back string, res Result, detail string, err error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		r.Body = http.MaxBytesReader(w, r.Body, 1<<20)
		if err := s.checkPost(r); err != nil {
			http.Error(w, err.Error(), http.StatusForbidden)
			return
		}
		who := s.who(r)
		if ok, why := s.canAct(who); !ok {
			http.Error(w, "refused: "+why, http.StatusForbidden)
			return
		}
		back, res, detail, err := do(r)
		if err != nil {
			msg := s.o.Mask(fmt.Sprintf("%s (%s): %d done before it failed: %v", what, detail, res.Done, err))
			s.o.Log.Warn("console action failed", "who", who, "action", what, "selection", detail, "done", res.Done, "err", s.o.Mask(err.Error()))
			http.Redirect(w, r, s.flash(back, "", msg), http.StatusSeeOther)
			return
		}
		s.o.Log.Info("console action", "who", who, "action", what, "selection", detail, "done", res.Done, "refused", res.Refused)
		msg := fmt.Sprintf("%s (%s): %d done", what, detail, res.Done)
		if res.Refused > 0 {
			msg += fmt.Sprintf(", %d refused", res.Refused)
		}
		if res.Note != "" {
			msg += ". " + res.Note
		}
		http.Redirect(w, r, s.flash(back, s.o.Mask(msg), ""), http.StatusSeeOther)
	}
}

// flash is the URL of page back with a banner this console signed.
func (s *Server) flash(back, done, failed string) string {
	return back + "?" + url.Values{"done": {done}, "failed": {failed}, "sig": {s.sign("flash", done+"\x00"+failed)}}.Encode()
}

func (s *Server) fleet(w http.ResponseWriter, r *http.Request) {
	f, err := s.b.Fleet(r.Context())
	s.render(w, r, "fleet", "Fleet", f, err)
}

func (s *Server) deadLetters(w http.ResponseWriter, r *http.Request) {
	d, err := s.b.DeadLetters(r.Context())
	s.render(w, r, "dlq", "Dead letters", d, err)
}

func (s *Server) outbox(w http.ResponseWriter, r *http.Request) {
	o, err := s.b.Outbox(r.Context())
	s.render(w, r, "outbox", "Outbox", o, err)
}

// eventPage is the event page's data.
type eventPage struct {
	ID, Text string
}

func (s *Server) event(w http.ResponseWriter, r *http.Request) {
	id := strings.TrimSpace(r.URL.Query().Get("id"))
	p := eventPage{ID: id}
	var err error
	if id != "" {
		if err = guard.ValidateID(id); err == nil {
			p.Text, err = s.b.Inspect(r.Context(), id)
		}
	}
	s.render(w, r, "event", "One event", p, err)
}

// selection reads a dead-letter selection from a form: a group, or the
// checked letters.
func selection(r *http.Request) (Selection, string, error) {
	sel := Selection{Keys: r.PostForm["key"]}
	if r.PostFormValue("group") != "" {
		sel.Reason, sel.Type, sel.Keys = r.PostFormValue("reason"), r.PostFormValue("type"), nil
		if sel.Reason == "" {
			return sel, "", fmt.Errorf("a group without its reason")
		}
		// What the page showed: no more letters, and none newer.
		n, err := strconv.Atoi(r.PostFormValue("shown"))
		if err != nil || n < 1 {
			return sel, "", fmt.Errorf("a group without the count the page showed")
		}
		newest, err := strconv.ParseInt(r.PostFormValue("newest"), 10, 64)
		if err != nil {
			return sel, "", fmt.Errorf("a group without the newest letter the page showed")
		}
		sel.Max = n
		if newest > 0 {
			sel.Before = time.Unix(0, newest)
		}
		return sel, fmt.Sprintf("reason %q, type %q, the %d shown", sel.Reason, sel.Type, n), nil
	}
	if len(sel.Keys) == 0 {
		return sel, "", fmt.Errorf("nothing selected: tick dead letters, or use a group's button")
	}
	sel.Max = len(sel.Keys)
	return sel, fmt.Sprintf("%d selected", len(sel.Keys)), nil
}

func (s *Server) replayLetters(r *http.Request) (string, Result, string, error) {
	sel, detail, err := selection(r)
	if err != nil {
		return "/dlq", Result{}, detail, err
	}
	res, err := s.b.ReplayLetters(r.Context(), sel)
	return "/dlq", res, detail, err
}

func (s *Server) purgeLetters(r *http.Request) (string, Result, string, error) {
	sel, detail, err := selection(r)
	if err != nil {
		return "/dlq", Result{}, detail, err
	}
	if r.PostFormValue("confirm") != "yes" {
		return "/dlq", Result{}, detail, fmt.Errorf("a purge cannot be undone: tick \"yes, delete them\" first")
	}
	res, err := s.b.PurgeLetters(r.Context(), sel)
	return "/dlq", res, detail, err
}

func (s *Server) replayOutbox(r *http.Request) (string, Result, string, error) {
	dest := r.PostFormValue("destination")
	ids := r.PostForm["id"]
	if dest == "" && len(ids) == 0 {
		return "/outbox", Result{}, "", fmt.Errorf("nothing selected: a destination's button, or tick dead rows")
	}
	detail := fmt.Sprintf("destination %q", dest)
	if len(ids) > 0 {
		detail = fmt.Sprintf("%d row(s) selected", len(ids))
	}
	res, err := s.b.ReplayOutbox(r.Context(), dest, ids)
	return "/outbox", res, detail, err
}

func (s *Server) loginPage(w http.ResponseWriter, r *http.Request) {
	s.render(w, r, "login", "Sign in", nil, nil)
}

func (s *Server) login(w http.ResponseWriter, r *http.Request) {
	r.Body = http.MaxBytesReader(w, r.Body, 1<<16)
	if err := s.checkPost(r); err != nil {
		http.Error(w, err.Error(), http.StatusForbidden)
		return
	}
	if s.o.Token == "" || subtle.ConstantTimeCompare([]byte(r.PostFormValue("token")), []byte(s.o.Token)) != 1 {
		s.o.Log.Warn("console: sign-in refused", "remote", r.RemoteAddr)
		http.Redirect(w, r, s.flash("/login", "", "wrong token"), http.StatusSeeOther)
		return
	}
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	v := time.Now().Add(sessionTTL).UTC().Format(time.RFC3339) + "." + hex.EncodeToString(b)
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: v + "." + s.sign("session", v), Path: "/",
		HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: secure(r), MaxAge: int(sessionTTL.Seconds())})
	s.o.Log.Info("console: signed in", "remote", r.RemoteAddr)
	http.Redirect(w, r, "/", http.StatusSeeOther)
}

func (s *Server) logout(w http.ResponseWriter, r *http.Request) {
	if err := s.checkPost(r); err != nil {
		http.Error(w, err.Error(), http.StatusForbidden)
		return
	}
	// The session ends here, not only in this browser: a copy of its
	// cookie is refused too.
	if c, err := r.Cookie(sessionCookie); err == nil {
		if exp, nonce, ok := s.session(c.Value); ok {
			s.mu.Lock()
			now := time.Now()
			for n, e := range s.revoked {
				if now.After(e) {
					delete(s.revoked, n)
				}
			}
			s.revoked[nonce] = exp
			s.mu.Unlock()
		}
	}
	http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: "", Path: "/", MaxAge: -1, HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: secure(r)})
	http.Redirect(w, r, "/", http.StatusSeeOther)
}
