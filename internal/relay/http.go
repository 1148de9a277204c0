package relay

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/idemhq/idem/internal/redact"
)

// httpConcurrency is how many keys' requests a pass has in flight at once.
const httpConcurrency = 16

// httpSender POSTs rows to HTTP destinations.
type httpSender struct {
	client *http.Client
	done   int // an extra status that counts as sent; 0: none
}

func newHTTPSender(timeout time.Duration, done int) *httpSender {
	return &httpSender{done: done, client: &http.Client{
		Timeout: timeout,
		// A redirected POST would become a GET: a 3xx is an answer, and dead.
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}}
}

// sendAll posts rows[idx]: the rows of one key one after another, in
// order, stopping at the first that fails (the later ones are skipped, so
// that they cannot overtake it), and up to httpConcurrency keys at once.
func (s *httpSender) sendAll(ctx context.Context, dests map[string]Destination, rows []*row, idx []int, results []result) error {
	if len(idx) == 0 {
		return nil
	}
	var keys []string
	byKey := map[string][]int{}
	for _, i := range idx {
		k := rows[i].destination + "\x00" + rows[i].key
		if rows[i].key == "" {
			k = rows[i].destination + "\x00" + rows[i].eventID
		}
		if _, ok := byKey[k]; !ok {
			keys = append(keys, k)
		}
		byKey[k] = append(byKey[k], i)
	}
	sem := make(chan struct{}, httpConcurrency)
	var wg sync.WaitGroup
	for _, k := range keys {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			failed := false
			for _, i := range byKey[k] {
				if failed || ctx.Err() != nil {
					results[i] = result{skipped: true}
					continue
				}
				results[i] = s.send(ctx, dests[rows[i].destination], rows[i])
				failed = !results[i].sent
			}
		})
	}
	wg.Wait()
	return nil
}

// send posts one row and classifies the answer: 2xx (and the configured
// done status) is sent; 408, 425, 429, 5xx and transport errors are tried
// again later; any other 4xx will not pass and is dead at once. Its error
// goes into the row's last_error and the relay's log: it quotes the URL with
// its credentials masked, and the start of the response's body as valid
// text.
func (s *httpSender) send(ctx context.Context, d Destination, w *row) result {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, d.URL, bytes.NewReader(w.body))
	if err != nil {
		return result{err: fmt.Errorf("http: %w", redactURL(err)), final: true}
	}
	for k, vs := range d.Header { // first: idem's own headers win
		// A copy: a request hook that adds to it never writes into the
		// destination's, which every concurrent request shares.
		ck := http.CanonicalHeaderKey(k)
		req.Header[ck] = append(req.Header[ck], vs...)
	}
	req.Header.Set("Content-Type", w.ctype)
	req.Header.Set("Idempotency-Key", w.messageID())
	if w.typ != "" {
		req.Header.Set("X-Idem-Type", w.typ)
	}
	req.Header.Set("X-Idem-Event-Id", w.eventID)
	if d.Request != nil {
		if err := d.Request(req); err != nil {
			// Stored and logged: masked, should it quote a header.
			return result{err: fmt.Errorf("http: the destination's request hook: %s", redact.Values(err.Error(), headerValues(d.Header)...))}
		}
	}
	resp, err := s.client.Do(req)
	if err != nil && ctx.Err() != nil {
		// The pass ended (its bound, or shutdown): not the destination's
		// answer, so no attempt is spent.
		return result{skipped: true}
	}
	if err != nil {
		return result{err: fmt.Errorf("http: %w", redactURL(err))}
	}
	defer resp.Body.Close()
	snippet := readSnippet(resp.Body, d.Header)
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20)) // let the connection be reused
	code := resp.StatusCode
	switch {
	case code >= 200 && code < 300, s.done != 0 && code == s.done:
		return result{sent: true}
	case code == http.StatusRequestTimeout, code == http.StatusTooEarly, code == http.StatusTooManyRequests, code >= 500:
		return result{err: fmt.Errorf("http %d: %s", code, snippet), after: retryAfter(resp.Header.Get("Retry-After"))}
	}
	return result{err: fmt.Errorf("http %d: %s", code, snippet), final: true}
}

// snippetLen is how much of an error response's body its error quotes, in
// bytes.
const snippetLen = 200

// readSnippet reads the start of a response's body for its error, as text
// a Postgres text column takes: valid UTF-8 (the cut may fall inside a
// character; a binary body is not text) and without NUL bytes. The values
// of header, the destination's own headers, are masked (an answer may
// quote the token it refused), even one the cut falls inside.
func readSnippet(body io.Reader, header http.Header) string {
	b, _ := io.ReadAll(io.LimitReader(body, snippetLen))
	s := strings.ReplaceAll(strings.ToValidUTF8(string(b), ""), "\x00", "")
	return strings.TrimSpace(redact.Values(s, headerValues(header)...))
}

// headerValues lists a destination's header values: secrets.
func headerValues(h http.Header) []string {
	var out []string
	for _, vs := range h {
		out = append(out, vs...)
	}
	return out
}

// redactURL masks the credentials in the URL a net/http error quotes
// (Post "https://api/x?access_token=…": dial tcp …): the error is stored
// and logged. net/http masks only the user info's password.
func redactURL(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		ue.URL = redact.URL(ue.URL)
	}
	return err
}

// retryAfter reads a Retry-After header given in seconds (0 if absent).
func retryAfter(v string) time.Duration {
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		return 0
	}
	return time.Duration(n) * time.Second
}
