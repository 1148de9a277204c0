package step

// The relay's steps (idem relay), in flow order.
const (
	RelayPublished = "after_relay_publish" // a claimed batch is published and confirmed, not yet marked sent
	RelayMarked    = "after_relay_mark"    // the batch is marked sent and committed
)

// Relay lists the relay's steps in flow order.
var Relay = []string{RelayPublished, RelayMarked}
