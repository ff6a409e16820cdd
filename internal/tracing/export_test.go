package tracing

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"go.opentelemetry.io/otel"
)

// The SDK's own errors go to the worker's log, one a minute at most, and
// an export error the exporter's watch already logged is not logged again.
func TestSDKErrorsAreLoggedOnceAMinute(t *testing.T) {
	var buf bytes.Buffer
	handleErrors(slog.New(slog.NewJSONHandler(&buf, nil)))
	otel.Handle(logged{errors.New("export refused")})
	otel.Handle(errors.New("span processor failed"))
	otel.Handle(errors.New("span processor failed again"))
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 1 || !strings.Contains(lines[0], `"error":"span processor failed"`) || !strings.Contains(lines[0], `"level":"WARN"`) {
		t.Errorf("logged %q, want one WARN line with the first processor error", lines)
	}
}
