// Package redact keeps passwords out of everything idem prints. One rule
// covers every form a connection setting can take, parseable or not:
//
//   - the password in a URL's user info (scheme://user:password@host),
//     even when the URL does not parse (a '/', '#' or bad %-escape in it),
//     and an HTTP URL's user name given alone (https://<token>@host);
//   - password-like parameters, in a URL query (?password=…) or a keyword
//     DSN (host=… password='…');
//   - URL query parameters whose name says they hold a credential
//     (?access_token=…, &X-Amz-Signature=…, &apiKey=…): an HTTP
//     destination's URL, and the net/http errors that quote it;
//   - HTTP header values an HTTP destination is configured with (a bearer
//     token, an API key), literally, and their credentials alone;
//   - an HTTP destination's URL credentials, literally, wherever its
//     answer quotes them (URLSecrets);
//   - and, for text that mangles those shapes (a parser's error quoting a
//     fragment), every secret found in the configured URLs, literally.
package redact

import (
	"encoding/base64"
	"io"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"sync"
	"unicode"
)

// Mask replaces every secret.
const Mask = "xxxxx"

// minLiteral is the shortest secret replaced wherever it appears; shorter
// ones would garble ordinary words, and are still masked in every URL and
// key=value shape.
const minLiteral = 4

var (
	// userinfo: scheme://user:password@ (greedy to the last @ of the token,
	// since unescaped passwords may hold '@', '/' or '#').
	userinfo = regexp.MustCompile(`([A-Za-z][A-Za-z0-9+.-]*://)([^:@/\s"']*):(\S*)@`)
	// tokenUser: http(s)://user@, a user name given alone, which an HTTP
	// endpoint's URL uses for a token (a database URL's is a role's name).
	tokenUser = regexp.MustCompile(`(?i)(\bhttps?://)([^:@/?#\s"']+)@`)
	// httpScheme: a connection string's scheme (what precedes "://") is
	// http or https.
	httpScheme = regexp.MustCompile(`(?i)(^|[^A-Za-z0-9+.-])https?$`)
	// param: password-like keys in a query or a keyword DSN, quoted or not.
	param = regexp.MustCompile(`(?i)\b((?:ssl)?pass(?:word)?|pwd|secret|token)(\s*=\s*)('(?:[^'\\]|\\.)*'|[^&\s"']*)`)
	// query: a URL query parameter whose name contains a credential's
	// word (credentialName), wherever the URL is quoted.
	query = regexp.MustCompile(`(?i)([?&][^=&#?\s"']*(?:` + credentialWords + `)[^=&#?\s"']*=)([^&#\s"']*)`)
	// credentialName matches a query parameter's name that holds a credential.
	credentialName = regexp.MustCompile(`(?i)` + credentialWords)
)

// credentialWords are the words that make a query parameter a credential
// when its name contains one: access_token, api_key, client_secret,
// X-Amz-Signature, password, auth.
const credentialWords = `token|key|secret|signature|password|auth`

// Redactor masks secrets in text. It is safe for concurrent use.
type Redactor struct {
	mu      sync.RWMutex
	secrets []string // longest first, so a secret's prefix never wins
}

// New returns a Redactor that also knows the secrets in conns.
func New(conns ...string) *Redactor {
	r := &Redactor{}
	r.Add(conns...)
	return r
}

// Add learns the secrets in each connection string (a URL or keyword DSN,
// valid or not).
func (r *Redactor) Add(conns ...string) {
	var found []string
	for _, c := range conns {
		found = append(found, Secrets(c)...)
	}
	r.learn(found)
}

// AddValues learns secrets given as they are, such as HTTP header values
// (see ValueSecrets).
func (r *Redactor) AddValues(values ...string) {
	var found []string
	for _, v := range values {
		found = append(found, ValueSecrets(v)...)
	}
	r.learn(found)
}

func (r *Redactor) learn(found []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range found {
		if len(s) >= minLiteral && !slices.Contains(r.secrets, s) {
			r.secrets = append(r.secrets, s)
		}
	}
	slices.SortFunc(r.secrets, func(a, b string) int { return len(b) - len(a) })
}

// String returns s with every secret masked.
func (r *Redactor) String(s string) string {
	s = String(s)
	r.mu.RLock()
	defer r.mu.RUnlock()
	for _, secret := range r.secrets {
		s = strings.ReplaceAll(s, secret, Mask)
	}
	return s
}

// Writer returns a writer that masks secrets in each Write before passing
// it to w. Loggers and fmt write a line per call, so a secret is never
// split across two writes.
func (r *Redactor) Writer(w io.Writer) io.Writer { return &writer{r: r, w: w} }

type writer struct {
	r *Redactor
	w io.Writer
}

func (w *writer) Write(p []byte) (int, error) {
	if _, err := io.WriteString(w.w, w.r.String(string(p))); err != nil {
		return 0, err
	}
	return len(p), nil
}

// String masks the secrets that have a recognisable shape in s: URL user
// info passwords, an HTTP URL's user name given alone, and password-like
// parameters.
func String(s string) string {
	s = userinfo.ReplaceAllString(s, "${1}${2}:"+Mask+"@")
	s = tokenUser.ReplaceAllString(s, "${1}"+Mask+"@")
	s = param.ReplaceAllString(s, "${1}${2}"+Mask)
	return query.ReplaceAllString(s, "${1}"+Mask)
}

// URL returns the URL u with its credentials masked, for printing an HTTP
// endpoint: the user info's password, or a user name given alone (a token,
// as in https://<token>@host/), and the value of every query parameter
// whose name contains a credential's word (token, key, secret, signature,
// password, auth; in any case). What does not parse is masked by shape,
// as String does.
func URL(u string) string {
	p, err := url.Parse(u)
	if err != nil {
		return String(u)
	}
	if p.User != nil {
		if _, ok := p.User.Password(); ok {
			p.User = url.UserPassword(p.User.Username(), Mask)
		} else if p.User.Username() != "" {
			p.User = url.User(Mask)
		}
	}
	if p.RawQuery != "" {
		// By hand, not through url.Values: the parameters keep their order
		// and spelling.
		params := strings.Split(p.RawQuery, "&")
		for i, kv := range params {
			k, _, ok := strings.Cut(kv, "=")
			name, err := url.QueryUnescape(k)
			if err != nil {
				name = k
			}
			if ok && credentialName.MatchString(name) {
				params[i] = k + "=" + Mask
			}
		}
		p.RawQuery = strings.Join(params, "&")
	}
	return String(p.String())
}

// ValueSecrets returns the secrets in a value given as it is, such as an
// HTTP header's: the whole value and, for "<scheme> <credentials>" (an
// Authorization header's "Bearer <token>"), the credentials alone, which an
// answer may quote without their scheme.
func ValueSecrets(v string) []string {
	v = strings.TrimSpace(v)
	out := []string{v}
	if _, cred, ok := strings.Cut(v, " "); ok {
		if cred = strings.TrimSpace(cred); cred != "" {
			out = append(out, cred)
		}
	}
	return out
}

// Values returns s with each of values (see ValueSecrets) masked where it
// appears whole, and a start of one, minLiteral bytes or longer, that ends
// s: s may be the start of a longer text (a response's body, read up to a
// limit) that cut one in two.
func Values(s string, values ...string) string {
	var secrets []string
	for _, v := range values {
		for _, secret := range ValueSecrets(v) {
			if len(secret) >= minLiteral {
				secrets = append(secrets, secret)
			}
		}
	}
	slices.SortFunc(secrets, func(a, b string) int { return len(b) - len(a) })
	for _, secret := range secrets {
		s = strings.ReplaceAll(s, secret, Mask)
	}
	for _, secret := range secrets {
		for n := len(secret) - 1; n >= minLiteral; n-- {
			if strings.HasSuffix(s, secret[:n]) {
				s = s[:len(s)-n] + Mask
				break
			}
		}
	}
	return s
}

// Secrets returns the secrets in one connection string, in every spelling
// they may be printed in (as written, %-decoded, unquoted).
func Secrets(conn string) []string {
	var out []string
	// A list of URLs (AMQP_URL's nodes, postgres.shards): each URL's own,
	// and only those. Read as one URL, the list's text between two URLs
	// would pass for a password, and a word such as the scheme with it.
	if strings.Count(conn, "://") > 1 {
		for _, one := range strings.FieldsFunc(conn, func(r rune) bool { return r == ',' || unicode.IsSpace(r) }) {
			out = append(out, Secrets(one)...)
		}
		return out
	}
	add := func(s string) {
		if s == "" {
			return
		}
		out = append(out, s)
		// A parser that fails on a password quotes the piece it split off
		// (url.Parse: `invalid port ":<up to the first '/'>"`).
		out = append(out, strings.FieldsFunc(s, func(r rune) bool { return strings.ContainsRune("/#?%@ ", r) })...)
		if d, err := url.PathUnescape(s); err == nil && d != s {
			out = append(out, d)
		}
		if d, err := url.QueryUnescape(s); err == nil && d != s {
			out = append(out, d)
		}
	}
	if scheme, rest, ok := strings.Cut(conn, "://"); ok {
		// The user info ends at an '@'; which one is unclear when the
		// password holds '@' unescaped, so take the first and the last.
		for _, at := range []int{strings.Index(rest, "@"), strings.LastIndex(rest, "@")} {
			if at < 0 {
				continue
			}
			if _, pw, ok := strings.Cut(rest[:at], ":"); ok {
				add(pw)
			}
		}
		// An HTTP URL's user name given alone is a token: the user info
		// of its authority (which ends at the first '/', '?' or '#').
		if httpScheme.MatchString(scheme) {
			authority := rest
			if end := strings.IndexAny(rest, "/?#"); end >= 0 {
				authority = rest[:end]
			}
			if at := strings.LastIndex(authority, "@"); at > 0 && !strings.Contains(authority[:at], ":") {
				add(authority[:at])
			}
		}
	}
	for _, m := range param.FindAllStringSubmatch(conn, -1) {
		v := m[3]
		if len(v) >= 2 && v[0] == '\'' && v[len(v)-1] == '\'' {
			v = strings.ReplaceAll(v[1:len(v)-1], `\'`, `'`)
		}
		add(v)
	}
	// A query parameter's value whole, not split as a password is: the
	// name matches paths too (sslkey=/home/app/…/postgresql.key), whose
	// pieces are ordinary words.
	for _, m := range query.FindAllStringSubmatch(conn, -1) {
		if v := m[2]; v != "" {
			out = append(out, v)
			if d, err := url.QueryUnescape(v); err == nil && d != v {
				out = append(out, d)
			}
		}
	}
	return out
}

// URLSecrets returns the credentials in an HTTP endpoint's URL u, those
// URL masks, in every form a request carries them and its answer may quote
// them: as written and %-decoded (see Secrets), and the Basic
// Authorization value net/http makes of the user info. Give them to Values
// to mask an answer's body.
func URLSecrets(u string) []string {
	out := Secrets(u)
	if p, err := url.Parse(u); err == nil && p.User != nil {
		pw, _ := p.User.Password()
		out = append(out, "Basic "+base64.StdEncoding.EncodeToString([]byte(p.User.Username()+":"+pw)))
	}
	return out
}

// Error returns err with the secrets of conns (and those of a recognisable
// shape) masked in its text, for a library's error about a connection
// setting: a URL parser quotes the URL, password and all. The result does
// not unwrap to err, whose text still holds them.
func Error(err error, conns ...string) error {
	if err == nil {
		return nil
	}
	return maskedError(New(conns...).String(err.Error()))
}

type maskedError string

func (e maskedError) Error() string { return string(e) }
