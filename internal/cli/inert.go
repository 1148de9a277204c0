package cli

import (
	"strconv"
	"strings"
	"unicode/utf8"
)

// inert returns s as it is when it is plain text, else Go-quoted: what a
// producer or a remote API wrote (a message ID, a header, a body, an HTTP
// answer) can then neither forge a line of the output nor send the terminal
// an escape sequence. Plain is valid UTF-8 of printable characters and
// spaces, not starting with '"' (so a quoted value is never mistaken for a
// plain one).
func inert(s string) string {
	if utf8.ValidString(s) && !strings.HasPrefix(s, `"`) &&
		!strings.ContainsFunc(s, func(r rune) bool { return !strconv.IsPrint(r) }) {
		return s
	}
	return strconv.Quote(s)
}
