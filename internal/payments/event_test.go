package payments

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/guard/guardtest"
)

func TestDecodeAcceptsTheSeedEvent(t *testing.T) {
	ev, err := Decode([]byte(`{"eventId":"evt_12345","userId":"user_42","type":"PAYMENT_COMPLETED","amount":1000}`))
	require.NoError(t, err)
	require.Equal(t, Event{EventID: "evt_12345", UserID: "user_42", Type: TypePaymentCompleted, Amount: 1000}, ev)
}

func TestHashIgnoresFormattingButNotContent(t *testing.T) {
	a, err := Decode([]byte(`{"eventId":"e1","userId":"u","type":"PAYMENT_COMPLETED","amount":5}`))
	require.NoError(t, err)
	b, err := Decode([]byte(`{ "amount": 5, "type":"PAYMENT_COMPLETED", "userId":"u", "eventId":"e1" }`))
	require.NoError(t, err)
	require.Equal(t, a.Hash(), b.Hash())
	c := a
	c.Amount = 6
	require.NotEqual(t, a.Hash(), c.Hash())
}

func TestDecodeRejectsBadInputWithReason(t *testing.T) {
	long := strings.Repeat("x", guard.MaxIDLen+1)
	pay := func(rest string) string {
		return `{"eventId":"e","userId":"u","type":"PAYMENT_COMPLETED","amount":1` + rest + `}`
	}
	cases := []struct {
		name, body, reason string
	}{
		{"not json", `{"eventId":`, ReasonInvalidJSON},
		{"empty body", ``, ReasonInvalidJSON},
		{"array", `[1,2]`, ReasonInvalidJSON},
		{"trailing data", `{"eventId":"e","userId":"u","type":"PAYMENT_COMPLETED","amount":1} {}`, ReasonInvalidJSON},
		{"missing eventId", `{"userId":"u","type":"PAYMENT_COMPLETED","amount":1}`, ReasonInvalidEventID},
		{"null eventId", `{"eventId":null,"userId":"u","type":"PAYMENT_COMPLETED","amount":1}`, ReasonInvalidEventID},
		{"empty eventId", `{"eventId":"","userId":"u","type":"PAYMENT_COMPLETED","amount":1}`, ReasonInvalidEventID},
		{"oversized eventId", `{"eventId":"` + long + `","userId":"u","type":"PAYMENT_COMPLETED","amount":1}`, ReasonInvalidEventID},
		{"eventId with a control character", `{"eventId":"evt\t1","userId":"u","type":"PAYMENT_COMPLETED","amount":1}`, ReasonInvalidEventID},
		{"eventId with a newline", `{"eventId":"evt\n1","userId":"u","type":"PAYMENT_COMPLETED","amount":1}`, ReasonInvalidEventID},
		{"invalid UTF-8 in userId", "{\"eventId\":\"e\",\"userId\":\"acct\xff\",\"type\":\"PAYMENT_COMPLETED\",\"amount\":1}", ReasonInvalidUTF8},
		{"invalid UTF-8 in eventId", "{\"eventId\":\"e\xfe\",\"userId\":\"u\",\"type\":\"PAYMENT_COMPLETED\",\"amount\":1}", ReasonInvalidUTF8},
		{"lone surrogate escape", `{"eventId":"e","userId":"acct\ud800","type":"PAYMENT_COMPLETED","amount":1}`, ReasonInvalidUTF8},
		{"NUL in userId", `{"eventId":"e","userId":"acct\u0000","type":"PAYMENT_COMPLETED","amount":1}`, ReasonNULCharacter},
		{"NUL in eventId", `{"eventId":"e\u0000","userId":"u","type":"PAYMENT_COMPLETED","amount":1}`, ReasonNULCharacter},
		{"duplicate key", `{"eventId":"e","userId":"u","userId":"v","type":"PAYMENT_COMPLETED","amount":1}`, ReasonDuplicateKey},
		{"duplicate amount", pay(`,"amount":2`), ReasonDuplicateKey},
		{"wrong-case key", `{"EVENTID":"e","userId":"u","type":"PAYMENT_COMPLETED","amount":1}`, ReasonUnknownField},
		{"unknown field", pay(`,"currency":"EUR"`), ReasonUnknownField},
		{"trailing braces", pay(`}}`), ReasonInvalidJSON},
		{"trailing garbage", pay(``) + `x`, ReasonInvalidJSON},
		{"bad occurredAt", pay(`,"occurredAt":"yesterday"`), ReasonInvalidField},
		{"numeric occurredAt", pay(`,"occurredAt":1700000000`), ReasonInvalidField},
		{"unprintable userId", `{"eventId":"e","userId":"a\u0007b","type":"PAYMENT_COMPLETED","amount":1}`, ReasonInvalidField},
		{"numeric eventId", `{"eventId":12,"userId":"u","type":"PAYMENT_COMPLETED","amount":1}`, ReasonInvalidField},
		{"missing userId", `{"eventId":"e","type":"PAYMENT_COMPLETED","amount":1}`, ReasonInvalidField},
		{"numeric userId", `{"eventId":"e","userId":42,"type":"PAYMENT_COMPLETED","amount":1}`, ReasonInvalidField},
		{"missing type", `{"eventId":"e","userId":"u","amount":1}`, ReasonInvalidField},
		{"unknown type", `{"eventId":"e","userId":"u","type":"PAYMENT_REVERSED","amount":1}`, ReasonUnknownType},
		{"missing amount", `{"eventId":"e","userId":"u","type":"PAYMENT_COMPLETED"}`, ReasonInvalidField},
		{"string amount", `{"eventId":"e","userId":"u","type":"PAYMENT_COMPLETED","amount":"1000"}`, ReasonInvalidField},
		{"negative amount", `{"eventId":"e","userId":"u","type":"PAYMENT_COMPLETED","amount":-5}`, ReasonInvalidField},
		{"zero amount", `{"eventId":"e","userId":"u","type":"PAYMENT_COMPLETED","amount":0}`, ReasonInvalidField},
		{"fractional amount", `{"eventId":"e","userId":"u","type":"PAYMENT_COMPLETED","amount":10.5}`, ReasonInvalidField},
		{"exponent amount", `{"eventId":"e","userId":"u","type":"PAYMENT_COMPLETED","amount":1e3}`, ReasonInvalidField},
		{"huge amount", `{"eventId":"e","userId":"u","type":"PAYMENT_COMPLETED","amount":99999999999999999999}`, ReasonInvalidField},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Decode([]byte(c.body))
			var re *consumer.RejectError
			require.ErrorAs(t, err, &re)
			require.Equal(t, c.reason, re.Reason, "err: %v", err)
		})
	}
}

// TestDecodeAcceptsOddButPrintableIDs: real producers' IDs are not all
// [A-Za-z0-9_-]; any printable UTF-8 up to guard.MaxIDLen bytes is an ID.
func TestDecodeAcceptsOddButPrintableIDs(t *testing.T) {
	for _, id := range guardtest.OddEventIDs {
		ev, err := Decode(Event{EventID: id, UserID: "u", Type: TypePaymentCompleted, Amount: 1}.Marshal())
		require.NoError(t, err, id)
		require.Equal(t, id, ev.EventID)
	}
}

func TestOccurredAtIsReadAndHashed(t *testing.T) {
	ev, err := Decode([]byte(`{"eventId":"e","userId":"u","type":"PAYMENT_COMPLETED","amount":1,"occurredAt":"2026-11-30T12:00:00+01:00"}`))
	require.NoError(t, err)
	require.Equal(t, time.Date(2026, 11, 30, 11, 0, 0, 0, time.UTC), ev.OccurredAt)
	without := ev
	without.OccurredAt = time.Time{}
	require.NotEqual(t, ev.Hash(), without.Hash(), "a re-send with another time is a conflict, not a duplicate")
	// Without occurredAt the hash is the one events had before the field existed.
	require.Equal(t, guard.HashFields("e", "u", TypePaymentCompleted, "1"), without.Hash())
}

func FuzzDecode(f *testing.F) {
	f.Add([]byte(`{"eventId":"evt_12345","userId":"user_42","type":"PAYMENT_COMPLETED","amount":1000}`))
	f.Add([]byte(`{"eventId":"e","amount":-1}`))
	f.Add([]byte(`[]`))
	f.Add([]byte(`{"eventId":"order#1/{x}","userId":"u","type":"PAYMENT_COMPLETED","amount":1,"occurredAt":"2026-11-30T12:00:00Z"}`))
	f.Add([]byte(`{"eventId":"e","eventId":"f"}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		ev, err := Decode(body)
		if err != nil {
			var re *consumer.RejectError
			if !errors.As(err, &re) || re.Reason == "" {
				t.Fatalf("error without a reason: %v", err)
			}
			return
		}
		// The standard decoder must read the same values.
		var std struct {
			EventID string `json:"eventId"`
			UserID  string `json:"userId"`
			Amount  int64  `json:"amount"`
		}
		if err := json.Unmarshal(body, &std); err != nil || std.EventID != ev.EventID || std.UserID != ev.UserID || std.Amount != ev.Amount {
			t.Fatalf("encoding/json reads %+v (%v), Decode %+v", std, err, ev)
		}
		// Whatever decodes must survive a round trip unchanged.
		again, err := Decode(ev.Marshal())
		if err != nil || again != ev {
			t.Fatalf("round trip: %+v -> %+v, %v", ev, again, err)
		}
	})
}
