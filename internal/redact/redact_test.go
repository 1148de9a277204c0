package redact

import (
	"bytes"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

// sentinel is the password every case hides; no output may contain it.
const sentinel = "Zq7sentinelPW"

// Forms lists a connection setting in every shape that leaked before, each
// carrying sentinel as its password.
var forms = map[string]string{
	"url":                   "postgres://app:" + sentinel + "@db:5432/x",
	"url with %zz":          "amqp://app:" + sentinel + "%zz@mq:5672/",
	"url with slash":        "redis://app:" + sentinel + "/x@cache:6379/0",
	"url with hash":         "amqp://app:" + sentinel + "#x@mq:5672/",
	"url with bad port":     "postgres://app:" + sentinel + "@db:port/x",
	"url with at":           "postgres://app:" + sentinel + "@x@db:5432/x",
	"password only":         "redis://:" + sentinel + "@cache:6379/0",
	"query password":        "postgres://db:5432/x?user=app&password=" + sentinel + "&sslmode=disable",
	"keyword dsn":           "host=db user=app password=" + sentinel + " dbname=x",
	"keyword dsn quoted":    "host=db user=app password='" + sentinel + " x' dbname=x",
	"keyword dsn spaced":    "host=db user=app password = " + sentinel + " dbname=x",
	"sslpassword":           "postgres://db/x?sslpassword=" + sentinel,
	"escaped in url":        "amqp://app:" + sentinel + "%21@mq:5672/",
	"upper-case param name": "postgres://db/x?PASSWORD=" + sentinel,
	"amqp node list":        "amqp://app:other1@mq1:5672/,amqp://app:" + sentinel + "@mq2:5672/",
	"shard list":            "postgres://app:other1@db1/x postgres://app:" + sentinel + "@db2/x",
	"query access_token":    "https://api.example.com/v1/x?access_token=" + sentinel,
	"query api key":         "https://api.example.com/v1/x?a=1&apiKey=" + sentinel + "&b=2",
	"query signature":       "https://bucket.example.com/o?X-Amz-Credential=c&X-Amz-Signature=" + sentinel,
	"query client secret":   "https://api.example.com/x?CLIENT_SECRET=" + sentinel + "#frag",
	"query auth":            "https://api.example.com/x?auth=" + sentinel,
	"destination list":      "mailer=https://mail.example.com/x?token=other1 api=https://api.example.com/x?sessionToken=" + sentinel,
	"token as user name":    "mailer=https://" + sentinel + "@api.example.com/v1/send",
	"token user in a list":  "receipts=queue:r mailer=https://" + sentinel + "@api.example.com/x api=https://u:other1@api.example.com/",
}

func TestEveryFormIsMasked(t *testing.T) {
	for name, conn := range forms {
		t.Run(name, func(t *testing.T) {
			r := New(conn)
			// As it is, quoted in an error, and as a parser might quote a fragment.
			for _, text := range []string{
				conn,
				fmt.Sprintf("parse %q: invalid URL escape", conn),
				"cannot parse `" + conn + "`: failed",
				"invalid port \":" + sentinel + "\" after host",
				"password authentication failed, password was " + sentinel,
			} {
				require.NotContains(t, r.String(text), sentinel, "in %q", text)
			}
			// The shape alone, without knowing the URL, masks the URL itself.
			require.NotContains(t, String(conn), sentinel)
		})
	}
}

func TestWriterMasksEachWrite(t *testing.T) {
	var buf bytes.Buffer
	w := New(forms["keyword dsn"]).Writer(&buf)
	n, err := fmt.Fprintf(w, "level=ERROR msg=%q\n", "dial "+sentinel)
	require.NoError(t, err)
	require.Positive(t, n)
	require.NotContains(t, buf.String(), sentinel)
	require.Contains(t, buf.String(), Mask)
}

// TestAURLListMasksOnlyPasswords: in a list of URLs without passwords,
// nothing is a secret, and the words of an error stay readable.
func TestAURLListMasksOnlyPasswords(t *testing.T) {
	r := New("postgres://postgres@db0:5432/pay?search_path=a postgres://postgres@db1:5432/pay", "amqp://app:pw-one-1@mq1/,amqp://app:pw-two-2@mq2/")
	msg := "postgres.shards: shard 1 of postgres://postgres@db1:5432/pay"
	require.Equal(t, msg, r.String(msg))
	require.Equal(t, "amqp://app:"+Mask+"@mq2/ amqp://app:"+Mask+"@mq1/", r.String("amqp://app:pw-two-2@mq2/ amqp://app:pw-one-1@mq1/"))
}

// TestAnHTTPURLsUserNameAloneIsASecret: https://<token>@host holds a
// token, as URL says; a database URL's user name alone is a role's name,
// and an '@' past the host is no user info.
func TestAnHTTPURLsUserNameAloneIsASecret(t *testing.T) {
	require.Equal(t, "POST https://"+Mask+"@api.example.com/x failed", String("POST https://"+sentinel+"@api.example.com/x failed"))
	for _, conn := range []string{"postgres://postgres@db:5432/pay", "https://api.example.com/users/@me", "https://api.example.com/x?to=a@b.example"} {
		require.Empty(t, Secrets(conn), conn)
		require.Equal(t, conn, String(conn))
	}
}

// TestURLSecretsCoverWhatAnAnswerMayQuote: an API's error body may quote
// the request's URL, a query parameter decoded, or the Authorization
// header net/http made of the user info.
func TestURLSecretsCoverWhatAnAnswerMayQuote(t *testing.T) {
	const b64 = "WnE3c2VudGluZWxQVzo=" // base64(sentinel + ":")
	for u, body := range map[string]string{
		"https://api.example.com/v1/pay?access_token=" + sentinel + "%21&region=eu": "invalid access_token '" + sentinel + "!' for /v1/pay?access_token=" + sentinel + "%21&region=eu",
		"https://" + sentinel + "@api.example.com/v1/pay":                           "unknown key " + sentinel + " (Authorization: Basic " + b64 + ")",
		"https://app:" + sentinel + "@api.example.com/v1/pay":                       "bad credentials: Basic YXBwOlpxN3NlbnRpbmVsUFc=",
	} {
		got := Values(body, URLSecrets(u)...)
		require.NotContains(t, got, sentinel, u)
		require.NotContains(t, got, b64, u)
		require.NotContains(t, got, "YXBwOlpxN3NlbnRpbmVsUFc=", u)
		require.Contains(t, got, Mask, u)
	}
	require.Equal(t, "region eu on /v1/pay", Values("region eu on /v1/pay", URLSecrets("https://api.example.com/v1/pay?region=eu")...))
}

func TestOrdinaryTextIsLeftAlone(t *testing.T) {
	r := New("amqp://guest:pw@127.0.0.1:5672/")
	for _, s := range []string{"consuming queue=payments.events", "redis://127.0.0.1:6379/0", "user=app host=db"} {
		require.Equal(t, s, r.String(s))
	}
	require.Equal(t, "amqp://guest:"+Mask+"@127.0.0.1:5672/", r.String("amqp://guest:pw@127.0.0.1:5672/"))
}

// TestURLMasksAnEndpointsCredentials: an HTTP destination's URL keeps what
// says where it goes and loses what lets one in.
func TestURLMasksAnEndpointsCredentials(t *testing.T) {
	for in, want := range map[string]string{
		"https://api.example.com/v1/pay?access_token=" + sentinel + "&region=eu": "https://api.example.com/v1/pay?access_token=" + Mask + "&region=eu",
		"https://api.example.com/x?page=2&Api%5FKey=" + sentinel:                 "https://api.example.com/x?page=2&Api%5FKey=" + Mask,
		"https://user:" + sentinel + "@api.example.com/x":                        "https://user:" + Mask + "@api.example.com/x",
		"https://" + sentinel + "@api.example.com/x":                             "https://" + Mask + "@api.example.com/x",
		"https://api.example.com/x?sslmode=disable&name=a":                       "https://api.example.com/x?sslmode=disable&name=a",
		"http://api.example.com:8080/hooks/pay":                                  "http://api.example.com:8080/hooks/pay",
		"https://api.example.com/%zz?token=" + sentinel:                          "https://api.example.com/%zz?token=" + Mask, // does not parse
	} {
		require.Equal(t, want, URL(in))
	}
}

// TestAnHTTPErrorQuotingTheURLIsMasked: net/http quotes the request's URL
// in its errors, which a relay stores and logs.
func TestAnHTTPErrorQuotingTheURLIsMasked(t *testing.T) {
	msg := `http: Post "https://api.example.com/x?access_token=` + sentinel + `&a=1": dial tcp 10.0.0.1:443: connect: connection refused`
	require.Equal(t, `http: Post "https://api.example.com/x?access_token=`+Mask+`&a=1": dial tcp 10.0.0.1:443: connect: connection refused`, String(msg))
	// Ordinary key=value text (a log line's attributes) is no URL query.
	require.Equal(t, "msg=sent key=user_1 token_count=3", String("msg=sent key=user_1 token_count=3"))
}

// TestHeaderValuesAreMaskedWholeAndAlone: an HTTP destination's header
// value is a secret as it is, and its credentials without their scheme (an
// answer that says "bad token <token>"), even when a cut took its end.
func TestHeaderValuesAreMaskedWholeAndAlone(t *testing.T) {
	const bearer = "Bearer " + sentinel
	for in, want := range map[string]string{
		"refused " + bearer:                 "refused " + Mask,
		"bad token " + sentinel + ", sorry": "bad token " + Mask + ", sorry",
		"cut at " + sentinel[:6]:            "cut at " + Mask,
		"cut at Zq7":                        "cut at Zq7", // shorter than minLiteral: ordinary text
		"nothing secret":                    "nothing secret",
	} {
		require.Equal(t, want, Values(in, bearer, "k1"), in)
	}
	r := New()
	r.AddValues(bearer)
	require.Equal(t, "level=WARN err=\"http 401: "+Mask+"\" again "+Mask, r.String("level=WARN err=\"http 401: "+bearer+"\" again "+sentinel))
	require.Equal(t, "Bearer tokens are checked", r.String("Bearer tokens are checked"), "the scheme alone is no secret")
}
