package cli_test

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/cli"
	"github.com/idemhq/idem/internal/redact"
)

// TestConfigMasksEveryCredentialOfADestination: idem config prints
// outbox.destinations with a token given as the URL's user name masked, as
// it masks a password after user: and a credential query parameter.
func TestConfigMasksEveryCredentialOfADestination(t *testing.T) {
	for name, dests := range map[string]string{
		"alone":   "mailer=https://Zq7sentinelUSER@api.example.com/v1/send",
		"in list": "receipts=queue:r mailer=https://Zq7sentinelUSER@api.example.com/v1/send api=https://app:Zq7sentinelPW@api.example.com/x?access_token=Zq7sentinelTOKEN",
	} {
		t.Run(name, func(t *testing.T) {
			t.Setenv("IDEM_OUTBOX_DESTINATIONS", dests)
			var out, errs bytes.Buffer
			require.NoError(t, cli.Run(context.Background(), []string{"config"}, &out, &errs), errs.String())
			var line string
			for l := range strings.Lines(out.String()) {
				if strings.HasPrefix(l, "outbox.destinations ") {
					line = l
				}
			}
			require.Contains(t, line, "mailer=https://"+redact.Mask+"@api.example.com/v1/send")
			require.NotContains(t, line, "Zq7sentinel")
			require.NotContains(t, out.String()+errs.String(), "Zq7sentinel")
		})
	}
}
