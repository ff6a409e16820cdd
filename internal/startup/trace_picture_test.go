package startup_test

import (
	"bytes"
	"cmp"
	"encoding/hex"
	"fmt"
	"html"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
)

// writeTracePicture writes the span tree of trace traceID, as the receiver
// got it, to the SVG file WORKER_TRACE_PICTURE names, if it names one:
// docs/images/one-trace.svg is made this way from a real run.
func writeTracePicture(t *testing.T, r *otlpReceiver, traceID string) {
	path := os.Getenv("WORKER_TRACE_PICTURE")
	if path == "" {
		return
	}
	r.mu.Lock()
	var spans []*tracepb.Span
	for _, s := range r.spans {
		if hex.EncodeToString(s.GetTraceId()) == traceID {
			spans = append(spans, s)
		}
	}
	r.mu.Unlock()
	if len(spans) == 0 {
		t.Fatalf("no span of trace %s to draw", traceID)
	}
	// Depth-first from the spans whose parent is not in the trace (the
	// producer's own span, which the worker does not export).
	byID := map[string]bool{}
	for _, s := range spans {
		byID[string(s.GetSpanId())] = true
	}
	type row struct {
		s     *tracepb.Span
		depth int
	}
	var rows []row
	var walk func(parent []byte, depth int, roots bool)
	walk = func(parent []byte, depth int, roots bool) {
		var kids []*tracepb.Span
		for _, s := range spans {
			if (roots && !byID[string(s.GetParentSpanId())]) || (!roots && bytes.Equal(s.GetParentSpanId(), parent)) {
				kids = append(kids, s)
			}
		}
		slices.SortFunc(kids, func(a, b *tracepb.Span) int {
			return int(int64(a.GetStartTimeUnixNano()) - int64(b.GetStartTimeUnixNano()))
		})
		for _, s := range kids {
			rows = append(rows, row{s, depth})
			walk(s.GetSpanId(), depth+1, false)
		}
	}
	walk(nil, 0, true)
	start, end := rows[0].s.GetStartTimeUnixNano(), rows[0].s.GetEndTimeUnixNano()
	for _, r := range rows {
		start, end = min(start, r.s.GetStartTimeUnixNano()), max(end, r.s.GetEndTimeUnixNano())
	}
	const labelW, barW, rowH = 330.0, 420.0, 26.0
	scale := barW / float64(max(end-start, 1))
	var b strings.Builder
	h := rowH*float64(len(rows)) + 44
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" font-family="sans-serif" font-size="12">`+"\n", labelW+barW+90, h)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/><text x="8" y="18" font-weight="bold">trace %s…, %s in all</text>`+"\n",
		traceID[:8], time.Duration(end-start).Round(100*time.Microsecond))
	colors := map[tracepb.Span_SpanKind]string{tracepb.Span_SPAN_KIND_PRODUCER: "#4e79a7", tracepb.Span_SPAN_KIND_CONSUMER: "#59a14f"}
	for i, r := range rows {
		y := 30 + rowH*float64(i)
		kind := strings.TrimPrefix(r.s.GetKind().String(), "SPAN_KIND_")
		fmt.Fprintf(&b, `<text x="%.0f" y="%.0f">%s <tspan fill="#777">%s</tspan></text>`+"\n",
			8+16*float64(r.depth), y+15, html.EscapeString(r.s.GetName()), kind)
		x := labelW + scale*float64(r.s.GetStartTimeUnixNano()-start)
		w := max(scale*float64(r.s.GetEndTimeUnixNano()-r.s.GetStartTimeUnixNano()), 2)
		fmt.Fprintf(&b, `<rect x="%.1f" y="%.0f" width="%.1f" height="16" rx="2" fill="%s"/><text x="%.1f" y="%.0f" fill="#333">%s</text>`+"\n",
			x, y+3, w, cmp.Or(colors[r.s.GetKind()], "#999"), x+w+4, y+15,
			time.Duration(r.s.GetEndTimeUnixNano()-r.s.GetStartTimeUnixNano()).Round(10*time.Microsecond))
	}
	b.WriteString("</svg>\n")
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
}
