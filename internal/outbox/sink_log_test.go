package outbox

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/testkit"
)

func logSinkEvent(i int) Event {
	return Event{
		Seq:           int64(i),
		EventID:       fmt.Sprintf("00000000-0000-4000-8000-%012d", i),
		AggregateType: "order",
		AggregateID:   fmt.Sprintf("order-%d", i%7),
		EventType:     "order.created",
		// As PostgreSQL renders jsonb: with spaces the sink may compact.
		Payload:    json.RawMessage(fmt.Sprintf(`{"n": %d, "items": [1, 2], "note": "caf\u00e9"}`, i)),
		Headers:    map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
		OccurredAt: time.Date(2024, 5, 6, 7, 8, 9, 123456000, time.FixedZone("KST", 9*3600)),
	}
}

func TestLogSinkWritesOneJSONLinePerEvent(t *testing.T) {
	var buf bytes.Buffer
	s := NewLogSink(&buf)
	if s.Name() != "log" {
		t.Fatalf("Name() = %q, want log", s.Name())
	}
	e := logSinkEvent(1)
	if err := s.Publish(context.Background(), e); err != nil {
		t.Fatal(err)
	}

	line := buf.String()
	if n := bytes.Count(buf.Bytes(), []byte("\n")); n != 1 || line[len(line)-1] != '\n' {
		t.Fatalf("want exactly one newline-terminated line, got %q", line)
	}
	var got struct {
		EventID       string            `json:"event_id"`
		AggregateType string            `json:"aggregate_type"`
		AggregateID   string            `json:"aggregate_id"`
		EventType     string            `json:"event_type"`
		OccurredAt    string            `json:"occurred_at"`
		Headers       map[string]string `json:"headers"`
		Payload       json.RawMessage   `json:"payload"`
	}
	dec := json.NewDecoder(&buf)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&got); err != nil {
		t.Fatalf("line is not the expected JSON object: %v\n%s", err, line)
	}
	if got.EventID != e.EventID || got.AggregateType != e.AggregateType || got.AggregateID != e.AggregateID || got.EventType != e.EventType {
		t.Errorf("identity fields = %+v, want those of %+v", got, e)
	}
	if want := "2024-05-05T22:08:09.123456Z"; got.OccurredAt != want {
		t.Errorf("occurred_at = %q, want %q (RFC 3339, UTC)", got.OccurredAt, want)
	}
	if !reflect.DeepEqual(got.Headers, e.Headers) {
		t.Errorf("headers = %v, want %v", got.Headers, e.Headers)
	}
	if got.Payload[0] != '{' {
		t.Errorf("payload must be embedded as raw JSON, not a string: %s", got.Payload)
	}
	if !sinkJSONEqual(t, got.Payload, e.Payload) {
		t.Errorf("payload = %s, want %s", got.Payload, e.Payload)
	}
}

func TestLogSinkEmptyHeadersAndPayload(t *testing.T) {
	var buf bytes.Buffer
	e := logSinkEvent(2)
	e.Headers, e.Payload = nil, nil
	if err := NewLogSink(&buf).Publish(context.Background(), e); err != nil {
		t.Fatal(err)
	}
	var got map[string]json.RawMessage
	if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	if string(got["headers"]) != "{}" || string(got["payload"]) != "null" {
		t.Errorf("headers = %s, payload = %s; want {} and null", got["headers"], got["payload"])
	}
}

type logSinkFailingWriter struct{}

func (logSinkFailingWriter) Write([]byte) (int, error) { return 0, errors.New("stdout closed") }

func TestLogSinkWriteErrorIsTransient(t *testing.T) {
	err := NewLogSink(logSinkFailingWriter{}).Publish(context.Background(), logSinkEvent(4))
	if err == nil || IsPermanent(err) {
		t.Fatalf("err = %v, want a transient error", err)
	}
}

// logSinkCallWriter is deliberately unsynchronized: the race detector fails the
// test if the sink lets two Writes overlap. It records each call so the
// test can check that a line is never split across calls.
type logSinkCallWriter struct{ calls [][]byte }

func (w *logSinkCallWriter) Write(p []byte) (int, error) {
	w.calls = append(w.calls, bytes.Clone(p))
	return len(p), nil
}

func TestLogSinkConcurrentPublishersNeverInterleave(t *testing.T) {
	const publishers, each = 8, 200
	w := &logSinkCallWriter{}
	s := NewLogSink(w)

	var wg sync.WaitGroup
	start := make(chan struct{})
	errs := make(chan error, publishers*each)
	for p := range publishers {
		wg.Go(func() {
			<-start
			for i := range each {
				if err := s.Publish(context.Background(), logSinkEvent(p*each+i)); err != nil {
					errs <- err
				}
			}
		})
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}

	if len(w.calls) > publishers*each {
		t.Fatalf("%d Write calls, want at most one per event (%d)", len(w.calls), publishers*each)
	}
	seen := map[string]bool{}
	for _, c := range w.calls {
		if !bytes.HasSuffix(c, []byte("\n")) {
			t.Fatalf("a Write must carry whole lines: %q", c)
		}
		sc := bufio.NewScanner(bytes.NewReader(c))
		for sc.Scan() {
			var l struct {
				EventID string `json:"event_id"`
			}
			if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
				t.Fatalf("corrupt line %q: %v", sc.Bytes(), err)
			}
			if seen[l.EventID] {
				t.Fatalf("event %s written twice", l.EventID)
			}
			seen[l.EventID] = true
		}
	}
	if len(seen) != publishers*each {
		t.Fatalf("%d distinct events, want %d", len(seen), publishers*each)
	}
}

// A Write that blocks (a full pipe) holds the publishes that come
// meanwhile; they go out together in the next Write, and each returns only
// after it: none returns before its line is written.
func TestLogSinkPublishesWaitingShareTheNextWrite(t *testing.T) {
	w := &logSinkGateWriter{entered: make(chan struct{}, 10), release: make(chan struct{})}
	s := NewLogSink(w)
	const waiting = 5
	first := make(chan error, 1)
	go func() { first <- s.Publish(context.Background(), logSinkEvent(0)) }()
	<-w.entered // the first Write is in progress and blocked
	done := make(chan error, waiting)
	for i := range waiting {
		go func() { done <- s.Publish(context.Background(), logSinkEvent(i+1)) }()
	}
	// Every waiting publish has added its line once the pending buffer
	// holds them all; none may return before its Write.
	testkit.Eventually(t, 10*time.Second, "the waiting lines to be pending", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return bytes.Count(s.pending, []byte("\n")) == waiting
	})
	select {
	case err := <-done:
		t.Fatalf("a publish returned (%v) before its line was written", err)
	default:
	}
	close(w.release)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	for range waiting {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	if len(w.calls) != 2 || bytes.Count(w.calls[1], []byte("\n")) != waiting {
		t.Fatalf("want the first line alone, then the %d waiting ones in one Write; got %q", waiting, w.calls)
	}
}

// logSinkGateWriter blocks every Write until release is closed.
type logSinkGateWriter struct {
	mu      sync.Mutex
	calls   [][]byte
	entered chan struct{}
	release chan struct{}
}

func (w *logSinkGateWriter) Write(p []byte) (int, error) {
	w.entered <- struct{}{}
	<-w.release
	w.mu.Lock()
	defer w.mu.Unlock()
	w.calls = append(w.calls, bytes.Clone(p))
	return len(p), nil
}

func sinkJSONEqual(t *testing.T, a, b []byte) bool {
	t.Helper()
	var x, y any
	if err := json.Unmarshal(a, &x); err != nil {
		t.Fatalf("%s: %v", a, err)
	}
	if err := json.Unmarshal(b, &y); err != nil {
		t.Fatalf("%s: %v", b, err)
	}
	return reflect.DeepEqual(x, y)
}

// BenchmarkLogSink measures the sink's cost per event, to compare with the
// relay's per-row budget (about 20µs at the 50k rows/s SQL ceiling).
func BenchmarkLogSink(b *testing.B) {
	s := NewLogSink(io.Discard)
	e := logSinkEvent(1)
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if err := s.Publish(ctx, e); err != nil {
			b.Fatal(err)
		}
	}
}

// The line's own fields are encoded byte for byte as encoding/json encodes
// them (HTML characters, control characters, U+2028, invalid UTF-8), and
// headers come out with sorted keys.
func TestLogSinkFieldsEncodeAsEncodingJSON(t *testing.T) {
	odd := "a<b>&\"q\"\\ \n\t\x01 é 😀 \u2028 \xff end"
	e := logSinkEvent(5)
	e.EventID, e.AggregateType, e.AggregateID, e.EventType = odd, "order"+odd, odd+"id", "t"+odd
	e.Headers = map[string]string{"z": "last", "a": odd, "tracestate": "k=v", odd: "key"}
	e.Payload = json.RawMessage(`1`)
	var buf bytes.Buffer
	if err := NewLogSink(&buf).Publish(context.Background(), e); err != nil {
		t.Fatal(err)
	}
	want, err := json.Marshal(struct {
		EventID       string            `json:"event_id"`
		AggregateType string            `json:"aggregate_type"`
		AggregateID   string            `json:"aggregate_id"`
		EventType     string            `json:"event_type"`
		OccurredAt    time.Time         `json:"occurred_at"`
		Headers       map[string]string `json:"headers"`
		Payload       json.RawMessage   `json:"payload"`
	}{e.EventID, e.AggregateType, e.AggregateID, e.EventType, e.OccurredAt.UTC(), e.Headers, e.Payload})
	if err != nil {
		t.Fatal(err)
	}
	if got := buf.String(); got != string(want)+"\n" {
		t.Errorf("line\n got %s\nwant %s", got, want)
	}
}

// The payload is copied through as PostgreSQL prints it; only line breaks
// (whitespace between tokens) are taken out, so an event stays one line.
func TestLogSinkCopiesPayloadThrough(t *testing.T) {
	for _, c := range []struct{ payload, want string }{
		{`{"n": 1, "html": "<a href=\"x\">&</a>", "s": "caf\u00e9 é"}`, `{"n": 1, "html": "<a href=\"x\">&</a>", "s": "caf\u00e9 é"}`},
		{"{\n  \"n\": 1,\r\n  \"s\": \"a\\nb\"\n}", `{"n":1,"s":"a\nb"}`},
		{`[1, 2.50, "x"]`, `[1, 2.50, "x"]`},
	} {
		var buf bytes.Buffer
		e := logSinkEvent(6)
		e.Payload = json.RawMessage(c.payload)
		if err := NewLogSink(&buf).Publish(context.Background(), e); err != nil {
			t.Fatal(err)
		}
		var got struct{ Payload json.RawMessage }
		if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
			t.Fatal(err)
		}
		if string(got.Payload) != c.want || bytes.Count(buf.Bytes(), []byte("\n")) != 1 {
			t.Errorf("payload %q: line %q, want payload %s on one line", c.payload, buf.String(), c.want)
		}
	}
}
