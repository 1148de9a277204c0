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

func TestOrdinaryTextIsLeftAlone(t *testing.T) {
	r := New("amqp://guest:pw@127.0.0.1:5672/")
	for _, s := range []string{"consuming queue=payments.events", "redis://127.0.0.1:6379/0", "user=app host=db"} {
		require.Equal(t, s, r.String(s))
	}
	require.Equal(t, "amqp://guest:"+Mask+"@127.0.0.1:5672/", r.String("amqp://guest:pw@127.0.0.1:5672/"))
}
