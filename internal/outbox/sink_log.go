package outbox

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"sync"
)

// LogSink writes one JSON line per event. It is the default sink: it needs
// nothing outside the process, so a fresh deployment shows its events on
// stdout before anyone has chosen a broker. It is safe for concurrent use.
//
// Concurrent publishes share their writes, as a database shares a WAL
// flush among the commits waiting for it: the lines that arrive while a
// Write is in progress go out together in the next one, and each of their
// publishes returns once that Write did. Stdout is usually a pipe to a log
// collector, and a pipe holds 64 KiB: one Write per line meant a wake-up of
// the reader, and often a wait for it, every few hundred bytes. A Write
// still carries whole lines only, and one at a time, so lines never
// interleave.
type LogSink struct {
	w io.Writer

	mu      sync.Mutex
	pending []byte    // whole lines for the next Write
	next    *logWrite // the next Write's outcome; nil when nothing is pending
	writing bool      // a publish is writing; it also writes what arrives meanwhile
	spare   []byte    // the last Write's buffer, for reuse
}

// logWrite is the outcome of one Write, shared by the publishes whose
// lines it carried: err is set before done is closed.
type logWrite struct {
	done chan struct{}
	err  error
}

// NewLogSink returns a sink that writes to w (usually os.Stdout).
func NewLogSink(w io.Writer) *LogSink { return &LogSink{w: w} }

// Name implements Sink.
func (s *LogSink) Name() string { return "log" }

// lineBuffers recycles line buffers: the sink runs once per event.
var lineBuffers = sync.Pool{New: func() any { return new([]byte) }}

// maxPooledLine keeps an occasional huge payload's buffer out of the pool.
const maxPooledLine = 64 << 10

// Publish implements Sink. A payload that is not valid JSON, or an
// occurred_at outside years 0001-9999 (no RFC 3339 form), is a permanent
// error, because writing it again cannot make it valid; a failed write is
// transient.
func (s *LogSink) Publish(_ context.Context, e Event) error {
	occurred, err := RFC3339(e.OccurredAt)
	if err != nil {
		return fmt.Errorf("log sink: event %s: %w", e.EventID, err)
	}
	buf := lineBuffers.Get().(*[]byte)
	defer func() {
		if cap(*buf) <= maxPooledLine {
			lineBuffers.Put(buf)
		}
	}()
	line, err := appendLogLine((*buf)[:0], e, occurred)
	*buf = line
	if err != nil {
		return Permanent(fmt.Errorf("log sink: event %s: encode: %w", e.EventID, err))
	}

	if err := s.write(line); err != nil {
		return fmt.Errorf("log sink: event %s: write: %w", e.EventID, err)
	}
	return nil
}

// write adds line to the next Write and returns that Write's error once it
// is done. The first publish to find no Write in progress writes, and
// keeps writing what the others added meanwhile until nothing is pending.
func (s *LogSink) write(line []byte) error {
	s.mu.Lock()
	s.pending = append(s.pending, line...)
	if s.next == nil {
		s.next = &logWrite{done: make(chan struct{})}
	}
	mine := s.next
	if s.writing {
		s.mu.Unlock()
		<-mine.done
		return mine.err
	}
	s.writing = true
	for s.next != nil {
		buf, w := s.pending, s.next
		s.pending, s.spare, s.next = s.spare[:0], nil, nil
		s.mu.Unlock()
		_, w.err = s.w.Write(buf)
		close(w.done)
		s.mu.Lock()
		if cap(buf) <= maxPooledLine {
			s.spare = buf
		}
	}
	s.writing = false
	s.mu.Unlock()
	return mine.err
}

// appendLogLine appends e as one line of JSON, with occurred as its
// occurred_at, fields in a fixed order so that lines are easy to read and
// to grep. It writes the JSON itself instead of going through
// encoding/json: this runs once per event, and the payload is already JSON
// (PostgreSQL prints jsonb), so it is copied through as it is.
func appendLogLine(b []byte, e Event, occurred string) ([]byte, error) {
	b = append(b, `{"event_id":`...)
	b = appendJSONString(b, e.EventID)
	b = append(b, `,"aggregate_type":`...)
	b = appendJSONString(b, e.AggregateType)
	b = append(b, `,"aggregate_id":`...)
	b = appendJSONString(b, e.AggregateID)
	b = append(b, `,"event_type":`...)
	b = appendJSONString(b, e.EventType)
	b = append(b, `,"occurred_at":"`...)
	b = append(b, occurred...)
	b = append(b, `","headers":`...)
	b = appendHeaders(b, e.Headers)
	b = append(b, `,"payload":`...)
	b, err := appendPayload(b, e.Payload)
	if err != nil {
		return b, err
	}
	return append(b, "}\n"...), nil
}

// appendJSONString appends s as a JSON string, escaped exactly as
// encoding/json escapes it. Plain ASCII, the usual case, is copied.
func appendJSONString(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= 0x7f || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			q, _ := json.Marshal(s) // cannot fail for a string
			return append(b, q...)
		}
	}
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"')
}

// appendHeaders appends the headers as a JSON object with sorted keys,
// `{}` when there are none, so consumers can rely on an object.
func appendHeaders(b []byte, h map[string]string) []byte {
	b = append(b, '{')
	var small [8]string // the usual few headers sort without an allocation
	keys := small[:0]
	for k := range h {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for i, k := range keys {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSONString(b, k)
		b = append(b, ':')
		b = appendJSONString(b, h[k])
	}
	return append(b, '}')
}

// appendPayload copies the payload through: JSON as PostgreSQL prints
// jsonb, on one line. The column is jsonb, so the payload is valid JSON
// and is not checked again here (json.Valid was an eighth of the worker's
// CPU in a drain); line breaks, which JSON allows only as whitespace
// between tokens, are compacted away so the event stays on its line. An
// empty payload is null.
func appendPayload(b []byte, p json.RawMessage) ([]byte, error) {
	if len(p) == 0 {
		return append(b, "null"...), nil
	}
	if bytes.ContainsAny(p, "\r\n") {
		var c bytes.Buffer
		if err := json.Compact(&c, p); err != nil {
			return b, err
		}
		return append(b, c.Bytes()...), nil
	}
	return append(b, p...), nil
}
