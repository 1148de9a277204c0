package config

import (
	"fmt"
	"net/http"
	"strings"

	"github.com/idemhq/idem/internal/relay"
)

// headerRef is one entry of outbox.headers: the header name of the HTTP
// destination dest, its value read from the environment variable env.
type headerRef struct {
	dest, name, env string
}

// String names the entry as written, without its value.
func (h headerRef) String() string { return h.dest + ":" + h.name }

// parseHeaders reads outbox.headers: <destination>:<Header-Name>=env:<VARIABLE>
// entries separated by spaces or newlines. Its errors never quote what
// follows an entry's '=' (a secret written where a variable's name belongs),
// and name an entry without one by its place.
func parseHeaders(s string) ([]headerRef, error) {
	var out []headerRef
	seen := map[string]bool{}
	for i, f := range strings.Fields(s) {
		left, value, ok := strings.Cut(f, "=")
		if !ok {
			return nil, fmt.Errorf("entry %d: want <destination>:<Header-Name>=env:<VARIABLE>", i+1)
		}
		dest, name, ok := strings.Cut(left, ":")
		if !ok || dest == "" || name == "" {
			return nil, fmt.Errorf("%q: want <destination>:<Header-Name>=env:<VARIABLE>", left)
		}
		h := headerRef{dest: dest, name: name}
		switch {
		case !isToken(name):
			return nil, fmt.Errorf("%s: %q is not a header name (letters, digits and !#$%%&'*+-.^_`|~)", h, name)
		case relay.ReservedHeader(name):
			return nil, fmt.Errorf("%s: idem or HTTP sets this header itself", h)
		case seen[dest+":"+http.CanonicalHeaderKey(name)]:
			return nil, fmt.Errorf("%s: header given twice", h)
		}
		seen[dest+":"+http.CanonicalHeaderKey(name)] = true
		env, ok := strings.CutPrefix(value, "env:")
		switch {
		case !ok:
			return nil, fmt.Errorf("%s: a value must come from the environment: write %s=env:<VARIABLE> and set the variable (a literal value is refused, so that no secret sits in a config file)", h, h)
		case !isEnvName(env):
			return nil, fmt.Errorf("%s: env: must be followed by a variable's name (letters, digits and _, not starting with a digit)", h)
		case strings.HasPrefix(env, "IDEM_"):
			return nil, fmt.Errorf("%s: %s: IDEM_* variables are idem's settings; read the value from a variable named otherwise", h, env)
		}
		h.env = env
		out = append(out, h)
	}
	return out, nil
}

// validateHeaders checks that each entry of outbox.headers names an HTTP
// destination of dests.
func validateHeaders(refs []headerRef, dests map[string]relay.Destination) error {
	for _, h := range refs {
		d, ok := dests[h.dest]
		switch {
		case !ok && len(dests) == 0:
			return bad("outbox.headers", "%s: %q is not one of outbox.destinations (empty)", h, h.dest)
		case !ok:
			return bad("outbox.headers", "%s: %q is not one of outbox.destinations (%s)", h, h.dest, strings.Join(relay.Names(dests), ", "))
		case d.Kind != relay.HTTP:
			return bad("outbox.headers", "%s: %q is %s, not an http(s) URL; only HTTP destinations take headers", h, h.dest, d)
		}
	}
	return nil
}

// readHeaders reads the values of outbox.headers (s, validated) from
// environ: destination name ⇒ its requests' headers; nil for none. Its
// errors name the variable, never its value.
func readHeaders(s string, environ []string) (map[string]http.Header, error) {
	refs, err := parseHeaders(s)
	if err != nil {
		return nil, bad("outbox.headers", "%v", err)
	}
	if len(refs) == 0 {
		return nil, nil
	}
	out := map[string]http.Header{}
	for _, h := range refs {
		v := lookupEnv(environ, h.env)
		switch {
		case v == "":
			return nil, bad("outbox.headers", "%s: the environment variable %s is unset or empty", h, h.env)
		case strings.ContainsFunc(v, func(r rune) bool { return (r < ' ' && r != '\t') || r == 0x7f }):
			return nil, bad("outbox.headers", "%s: the value of %s holds a line break or another control character, which a header cannot", h, h.env)
		}
		if out[h.dest] == nil {
			out[h.dest] = http.Header{}
		}
		out[h.dest].Set(h.name, v)
	}
	return out, nil
}

// lookupEnv returns the value of k in environ (the last one, as applyEnv
// reads them), or "".
func lookupEnv(environ []string, k string) string {
	v := ""
	for _, kv := range environ {
		if name, val, ok := strings.Cut(kv, "="); ok && name == k {
			v = val
		}
	}
	return v
}

// isToken reports whether s is an HTTP token (RFC 9110 5.6.2), as a header
// name must be.
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("!#$%&'*+-.^_`|~", r)) {
			return false
		}
	}
	return true
}

// isEnvName reports whether s can name an environment variable a shell
// sets.
func isEnvName(s string) bool {
	if s == "" || s[0] >= '0' && s[0] <= '9' {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_') {
			return false
		}
	}
	return true
}

// parseFinalStatuses reads outbox.final_statuses: <destination>=<statuses>
// separated by spaces, <statuses> as relay.ParseStatuses takes them or
// "none".
func parseFinalStatuses(s string) (map[string][]int, error) {
	out := map[string][]int{}
	for _, f := range strings.Fields(s) {
		name, list, ok := strings.Cut(f, "=")
		if !ok || name == "" || list == "" {
			return nil, fmt.Errorf("%q: want <destination>=<statuses> (400,404,409-422) or <destination>=none", f)
		}
		if _, dup := out[name]; dup {
			return nil, fmt.Errorf("%q: destination named twice", name)
		}
		if list == "none" {
			out[name] = []int{}
			continue
		}
		codes, err := relay.ParseStatuses(list)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		out[name] = codes
	}
	return out, nil
}
