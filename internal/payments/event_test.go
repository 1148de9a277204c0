package payments

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/pkg/consumer"
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
	long := strings.Repeat("x", 129)
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
		{"eventId charset", `{"eventId":"evt 1","userId":"u","type":"PAYMENT_COMPLETED","amount":1}`, ReasonInvalidEventID},
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

func FuzzDecode(f *testing.F) {
	f.Add([]byte(`{"eventId":"evt_12345","userId":"user_42","type":"PAYMENT_COMPLETED","amount":1000}`))
	f.Add([]byte(`{"eventId":"e","amount":-1}`))
	f.Add([]byte(`[]`))
	f.Fuzz(func(t *testing.T, body []byte) {
		ev, err := Decode(body)
		if err != nil {
			var re *consumer.RejectError
			if !errors.As(err, &re) || re.Reason == "" {
				t.Fatalf("error without a reason: %v", err)
			}
			return
		}
		// Whatever decodes must survive a round trip unchanged.
		again, err := Decode(ev.Marshal())
		if err != nil || again != ev {
			t.Fatalf("round trip: %+v -> %+v, %v", ev, again, err)
		}
	})
}
