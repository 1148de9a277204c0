package idem

import (
	"net/url"
	"strings"
)

// hasParam reports whether a PostgreSQL URL or DSN sets param.
func hasParam(dsn, param string) bool {
	if u, err := url.Parse(dsn); err == nil && u.Scheme != "" {
		return u.Query().Has(param)
	}
	return strings.Contains(dsn, param+"=")
}
