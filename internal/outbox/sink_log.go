package outbox

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"sync"
)

// LogSink writes one JSON line per event. It is the default sink: it needs
// nothing outside the process, so a fresh deployment shows its events on
// stdout before anyone has chosen a broker.
type LogSink struct {
	mu sync.Mutex // one Write per line, so lines from concurrent relays never interleave
	w  io.Writer
}

// NewLogSink returns a sink that writes to w (usually os.Stdout).
func NewLogSink(w io.Writer) *LogSink { return &LogSink{w: w} }

// Name implements Sink.
func (s *LogSink) Name() string { return "log" }

// logLine is the shape of one line. Field order is fixed so that lines are
// easy to read and to grep.
type logLine struct {
	EventID       string            `json:"event_id"`
	AggregateType string            `json:"aggregate_type"`
	AggregateID   string            `json:"aggregate_id"`
	EventType     string            `json:"event_type"`
	OccurredAt    string            `json:"occurred_at"` // RFC 3339, UTC
	Headers       map[string]string `json:"headers"`
	Payload       json.RawMessage   `json:"payload"`
}

// Publish implements Sink. A payload that is not valid JSON, or an
// occurred_at outside years 0001-9999 (no RFC 3339 form), is a permanent
// error, because writing it again cannot make it valid; a failed write is
// transient.
func (s *LogSink) Publish(_ context.Context, e Event) error {
	occurred, err := rfc3339(e.OccurredAt)
	if err != nil {
		return fmt.Errorf("log sink: event %s: %w", e.EventID, err)
	}
	l := logLine{
		EventID:       e.EventID,
		AggregateType: e.AggregateType,
		AggregateID:   e.AggregateID,
		EventType:     e.EventType,
		OccurredAt:    occurred,
		Headers:       e.Headers,
		Payload:       e.Payload,
	}
	if l.Headers == nil {
		l.Headers = map[string]string{} // consumers can rely on an object
	}
	if len(l.Payload) == 0 {
		l.Payload = nil // encodes as null; an empty RawMessage is invalid JSON
	}
	b, err := json.Marshal(l)
	if err != nil {
		return Permanent(fmt.Errorf("log sink: event %s: encode: %w", e.EventID, err))
	}
	b = append(b, '\n')

	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.w.Write(b); err != nil {
		return fmt.Errorf("log sink: event %s: write: %w", e.EventID, err)
	}
	return nil
}
