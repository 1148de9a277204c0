package loadgen

import (
	"encoding/json"
	"fmt"
	"os"
	"time"

	"github.com/idemhq/idem/internal/payments"
)

// Manifest records what a publish run sent.
type Manifest struct {
	RunID     string          `json:"runId"`
	Queue     string          `json:"queue"`
	Seed      uint64          `json:"seed"`
	Messages  int             `json:"messages"`
	Published time.Time       `json:"published"`
	Events    []ManifestEvent `json:"events"`
}

// ManifestEvent is one distinct event and how many messages carried it.
type ManifestEvent struct {
	payments.Event
	Sends int `json:"sends"`
}

// NewManifest summarises a stream.
func NewManifest(spec StreamSpec, queue string, s Stream) Manifest {
	m := Manifest{RunID: spec.RunID, Queue: queue, Seed: spec.Seed, Messages: len(s.Order), Published: time.Now().UTC()}
	m.Events = make([]ManifestEvent, len(s.Events))
	for i, ev := range s.Events {
		m.Events[i].Event = ev
	}
	for _, i := range s.Order {
		m.Events[i].Sends++
	}
	return m
}

// Write saves m as JSON at path.
func (m Manifest) Write(path string) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}

// ReadManifest loads a manifest written by Write.
func ReadManifest(path string) (Manifest, error) {
	var m Manifest
	b, err := os.ReadFile(path)
	if err != nil {
		return m, err
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, fmt.Errorf("manifest %s: %w", path, err)
	}
	if m.RunID == "" || len(m.Events) == 0 {
		return m, fmt.Errorf("manifest %s: no run id or no events", path)
	}
	return m, nil
}
