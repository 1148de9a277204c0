package broker

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestTopologyNamesFollowTheQueue(t *testing.T) {
	top := TopologyFor("payments.events", 20)
	require.Equal(t, "payments.events.dlx", top.DeadLetterExchange)
	require.Equal(t, "payments.events.dlq", top.DeadLetterQueue)
}
