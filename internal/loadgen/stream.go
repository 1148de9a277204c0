// Package loadgen builds and publishes a reproducible stream of payment
// events with duplicates, and records what it sent in a manifest that
// `idem verify` checks the database against.
package loadgen

import (
	"fmt"
	"math/rand/v2"
	"strconv"

	"github.com/idemhq/idem/internal/payments"
)

// RunID derives a short run id from a seed, for event and user ids.
func RunID(seed uint64) string { return strconv.FormatUint(seed%1_000_000_000, 36) }

// StreamSpec describes a stream. The same spec and seed give the same stream.
type StreamSpec struct {
	// RunID prefixes event and user IDs so runs never collide.
	RunID string
	// Count is the number of distinct events.
	Count int
	// Users is the number of distinct users the payments spread over.
	Users int
	// DupRatio is extra sends as a fraction of Count: 0.25 sends a quarter
	// more messages, each a re-send of an event of the stream.
	DupRatio float64
	// DelayWindow is how many messages later a delayed re-send may come.
	DelayWindow int
	// Seed drives every random choice.
	Seed uint64
}

// Stream is the events of a spec and the order their messages go out in.
type Stream struct {
	Events []payments.Event
	// Order lists indexes into Events, one per message, duplicates included.
	Order []int
	// BackToBack and Delayed count the re-sends of each kind.
	BackToBack, Delayed int
}

// Build returns the stream for spec. Half of the re-sends follow their
// original at once (two consumers then often hold the event at the same
// time); the other half come up to DelayWindow messages later.
func Build(spec StreamSpec) (Stream, error) {
	switch {
	case spec.Count < 1:
		return Stream{}, fmt.Errorf("count must be at least 1, got %d", spec.Count)
	case spec.Users < 1:
		return Stream{}, fmt.Errorf("users must be at least 1, got %d", spec.Users)
	case spec.DupRatio < 0 || spec.DupRatio > 10:
		return Stream{}, fmt.Errorf("dup ratio must be in [0, 10], got %g", spec.DupRatio)
	case spec.DelayWindow < 1:
		spec.DelayWindow = 1000
	}
	rng := rand.New(rand.NewPCG(spec.Seed, 0x1de))
	s := Stream{Events: make([]payments.Event, spec.Count)}
	for i := range s.Events {
		s.Events[i] = payments.Event{
			EventID: fmt.Sprintf("evt_%s_%d", spec.RunID, i),
			UserID:  fmt.Sprintf("user_%s_%d", spec.RunID, rng.IntN(spec.Users)),
			Type:    payments.TypePaymentCompleted,
			Amount:  int64(100 + rng.IntN(100_000)),
		}
	}
	after := make([][]int, spec.Count) // re-sends to emit after position i
	extra := int(float64(spec.Count)*spec.DupRatio + 0.5)
	for k := range extra {
		j := rng.IntN(spec.Count)
		if k%2 == 0 {
			after[j] = append(after[j], j)
			s.BackToBack++
			continue
		}
		p := min(spec.Count-1, j+1+rng.IntN(spec.DelayWindow))
		after[p] = append(after[p], j)
		s.Delayed++
	}
	s.Order = make([]int, 0, spec.Count+extra)
	for i := range spec.Count {
		s.Order = append(s.Order, i)
		s.Order = append(s.Order, after[i]...)
	}
	return s, nil
}
