package relay

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/idemhq/idem/internal/redact"
)

// httpConcurrency is how many keys' requests a pass has in flight at once.
const httpConcurrency = 16

// reservedHeaders are the headers, besides the X-Idem- ones, that a
// destination's headers may not name: idem sets them on every request
// (Content-Type, Idempotency-Key), or net/http drops, replaces or acts on
// them itself (Host, Content-Length, ...), so a configured value would be
// lost or would break the request.
var reservedHeaders = []string{"Content-Type", "Idempotency-Key",
	"Host", "Content-Length", "Transfer-Encoding", "Trailer", "Connection"}

// idemHeaderPrefix begins the headers idem sets about a message
// (X-Idem-Type, X-Idem-Event-Id) and any it may add.
const idemHeaderPrefix = "X-Idem-"

// ReservedHeader reports whether name, in any case, is a header that idem
// or net/http sets on a request to an HTTP destination, which the
// destination's own headers may not name (outbox.headers,
// outbox.Destination.Header).
func ReservedHeader(name string) bool {
	if len(name) >= len(idemHeaderPrefix) && strings.EqualFold(name[:len(idemHeaderPrefix)], idemHeaderPrefix) {
		return true
	}
	return slices.ContainsFunc(reservedHeaders, func(h string) bool { return strings.EqualFold(h, name) })
}

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
// that they cannot overtake it), and up to httpConcurrency keys at once; a
// request that could not meet its own timeout before ctx's deadline is not
// started (timeLeft).
// Its error says why rows were held back unsent (a request hook failed):
// no answer of a destination's, so, as a broker out of reach, it is the
// pass's error, and spends no attempt.
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
				if failed || ctx.Err() != nil || !s.timeLeft(ctx) {
					results[i] = result{skipped: true}
					continue
				}
				results[i] = s.send(ctx, dests[rows[i].destination], rows[i])
				failed = !results[i].sent
			}
		})
	}
	wg.Wait()
	return heldBack(rows, idx, results)
}

// timeLeft reports whether a request started now meets its own timeout
// before ctx's deadline: one that could not is not started (the pass would
// cut it off mid-flight, after the API may have acted on it, and send it
// again), and its row waits for the next pass, spending nothing.
func (s *httpSender) timeLeft(ctx context.Context) bool {
	deadline, ok := ctx.Deadline()
	return !ok || s.client.Timeout <= 0 || time.Until(deadline) >= s.client.Timeout
}

// heldBack sums up the rows of rows[idx] whose results were held back:
// for each destination, the first reason and how many; nil if none.
func heldBack(rows []*row, idx []int, results []result) error {
	type held struct {
		err error
		n   int
	}
	by := map[string]*held{}
	var names []string
	for _, i := range idx {
		if results[i].held == nil {
			continue
		}
		d := rows[i].destination
		if by[d] == nil {
			by[d] = &held{err: results[i].held}
			names = append(names, d)
		}
		by[d].n++
	}
	slices.Sort(names)
	var errs []error
	for _, d := range names {
		errs = append(errs, fmt.Errorf("http: destination %s: %w; %d request(s) not sent, no attempt spent", d, by[d].err, by[d].n))
	}
	return errors.Join(errs...)
}

// classUnavailable is the pause class of the answers an API down or
// overloaded gives, which it mixes: a 5xx, 408, 425 or 429, or no answer.
const classUnavailable = "http unavailable (5xx, 408, 425, 429, no answer)"

// send posts one row and classifies the answer: 2xx (and the configured
// done status) is sent; a status the destination holds final (by default
// a 3xx or 4xx but 401, 403, 408, 425 and 429: Destination.Final) is dead
// at once; any other, and no answer, is tried again later, and counts
// towards the destination's pause in its class. Its error
// goes into the row's last_error and the relay's log: it quotes the URL with
// its credentials masked, and the start of the response's body as valid
// text, with the values of the destination's headers and of those the
// request hook set masked, and the URL's credentials (redact.URLSecrets).
//
// A request hook that fails, or does not return within the request's
// timeout, is no answer of the destination's: the row is skipped, no
// attempt spent, and held says why, for the pass to report.
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
	if t := w.sourceTime(); t != "" {
		req.Header.Set("X-Idem-Source-Time", t)
	}
	// What the answer must not quote: the header values, and the URL's
	// credentials (an API may echo the request's ?access_token=…).
	secrets := append(headerValues(d.Header), redact.URLSecrets(d.URL)...)
	if d.Request != nil {
		set, err := s.runHook(ctx, d.Request, req)
		secrets = append(secrets, set...)
		switch {
		case ctx.Err() != nil:
			// The pass ended (its bound, or shutdown) while the hook ran.
			return result{skipped: true}
		case err != nil:
			// Logged and shown by /readyz: masked, should it quote a header.
			return result{skipped: true, held: fmt.Errorf("the request hook: %s", redact.Values(err.Error(), secrets...))}
		}
		secrets = append(secrets, redact.URLSecrets(req.URL.String())...) // a hook may sign the URL
	}
	resp, err := s.client.Do(req)
	if err != nil && ctx.Err() != nil {
		// The pass ended (its bound, or shutdown): not the destination's
		// answer, so no attempt is spent.
		return result{skipped: true}
	}
	if err != nil {
		return result{err: fmt.Errorf("http: %w", redactURL(err)), class: classUnavailable}
	}
	defer resp.Body.Close()
	snippet := readSnippet(resp.Body, secrets)
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20)) // let the connection be reused
	code := resp.StatusCode
	switch {
	case code >= 200 && code < 300, s.done != 0 && code == s.done:
		return result{sent: true}
	case d.final(code):
		return result{err: fmt.Errorf("http %d: %s", code, snippet), final: true}
	}
	class := fmt.Sprintf("http %d", code)
	if code >= 500 || code == http.StatusRequestTimeout || code == http.StatusTooEarly || code == http.StatusTooManyRequests {
		class = classUnavailable
	}
	return result{err: fmt.Errorf("http %d: %s", code, snippet), after: retryAfter(resp.Header.Get("Retry-After")), class: class}
}

// runHook calls hook on req and waits for it until ctx ends or the
// request's timeout passes, whichever is first: a hook that ignores
// req.Context() (a signer waiting on a key service with a context of its
// own) never holds a pass, or Run, past its bound. Such a hook is left to
// return on its own, its request never sent. It returns the header values
// the hook added or changed: secrets, as the destination's own are (a
// token the hook fetched), to be masked wherever the answer quotes them.
func (s *httpSender) runHook(ctx context.Context, hook func(*http.Request) error, req *http.Request) ([]string, error) {
	before := req.Header.Clone()
	done := make(chan error, 1) // the hook's send never blocks, should nobody wait
	go func() { done <- hook(req) }()
	var timeout <-chan time.Time // none without a request timeout
	if s.client.Timeout > 0 {
		t := time.NewTimer(s.client.Timeout)
		defer t.Stop()
		timeout = t.C
	}
	select {
	case err := <-done:
		return hookValues(before, req.Header), err
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-timeout:
		// What it set so far cannot be read while it runs; nothing was
		// sent, so nothing can quote it.
		return nil, fmt.Errorf("did not return within %s (a hook must return once req.Context() ends)", s.client.Timeout)
	}
}

// hookValues returns the values in after that before does not hold under
// the same name: those a request hook added or changed.
func hookValues(before, after http.Header) []string {
	var out []string
	for k, vs := range after {
		for _, v := range vs {
			if !slices.Contains(before[k], v) {
				out = append(out, v)
			}
		}
	}
	return out
}

// snippetLen is how much of an error response's body its error quotes, in
// bytes.
const snippetLen = 200

// readSnippet reads the start of a response's body for its error, as text
// a Postgres text column takes: valid UTF-8 (the cut may fall inside a
// character; a binary body is not text) and without NUL bytes. secrets
// (the request's header values a destination or its hook set, and its
// URL's credentials) are masked
// (an answer may quote the token it refused), even one the cut falls
// inside; redact.Values leaves a value shorter than 4 bytes, too short to
// be a credential, where masking it would garble ordinary words.
func readSnippet(body io.Reader, secrets []string) string {
	b, _ := io.ReadAll(io.LimitReader(body, snippetLen))
	s := strings.ReplaceAll(strings.ToValidUTF8(string(b), ""), "\x00", "")
	return strings.TrimSpace(redact.Values(s, secrets...))
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
