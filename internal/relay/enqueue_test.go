package relay_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/outbox"
)

// TestEnqueueRefusesWhatCanNeverBePublished: a message the relay could never
// publish (an AMQP short string over 255 bytes, text Postgres cannot store,
// a header net/http will not send) is refused in the handler's transaction,
// naming the field, instead of going dead in the outbox or holding its key's
// later messages back.
func TestEnqueueRefusesWhatCanNeverBePublished(t *testing.T) {
	t.Parallel()
	db, _ := testenv.Schema(t)
	g := newGuard(t, db)
	ctx := context.Background()
	for i, c := range []struct {
		name string
		m    outbox.Message
		want string
	}{
		// 128 two-byte runes: the limit counts bytes.
		{"long type", outbox.Message{Type: strings.Repeat("é", 128)}, "Type is 256 bytes long; the limit is 255 bytes"},
		{"long content type", outbox.Message{ContentType: strings.Repeat("a", 256)}, "ContentType is 256 bytes long; the limit is 255 bytes"},
		{"long key", outbox.Message{Key: strings.Repeat("k", 300)}, "Key is 300 bytes long; the limit is 255 bytes"},
		{"type not UTF-8", outbox.Message{Type: "PAID\xff"}, "Type is not valid UTF-8"},
		{"key not UTF-8", outbox.Message{Key: "user\xc3"}, "Key is not valid UTF-8"},
		{"NUL in key", outbox.Message{Key: "user\x001"}, "Key holds a NUL byte"},
		{"NUL in content type", outbox.Message{ContentType: "text/plain\x00"}, "ContentType holds a NUL byte"},
		{"NUL in destination", outbox.Message{To: "api\x00"}, "To holds a NUL byte"},
		{"newline in type", outbox.Message{Type: "PAID\r\nX-Evil: 1"}, "Type holds a control character"},
	} {
		id := fmt.Sprintf("e%d", i)
		c.m.EventID = id
		if c.m.To == "" {
			c.m.To = "api"
		}
		_, err := g.Process(ctx, guard.Event{ID: id, Hash: guard.HashFields(id)}, func(ctx context.Context, tx pgx.Tx) error {
			return outbox.Enqueue(ctx, tx, c.m)
		})
		require.ErrorContains(t, err, c.want, c.name)
	}
	require.Equal(t, map[string]int{}, states(t, db), "a refused message leaves no row")

	// At the limit, and with a tab, it passes.
	send(t, g, "e_ok", outbox.Message{EventID: "e_ok", To: "api", Key: strings.Repeat("k", 255),
		Type: strings.Repeat("é", 127) + "a", ContentType: "text/plain;\tcharset=utf-8"})
	require.Equal(t, map[string]int{"pending": 1}, states(t, db))
}
