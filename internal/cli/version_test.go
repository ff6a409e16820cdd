package cli

import (
	"bytes"
	"encoding/json"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/worker-dev/worker/internal/startup"
)

// Scripts read `worker version --output json`: its keys and their types are
// a contract (docs/operations.md), so a renamed or dropped key fails here.
func TestVersionJSONShape(t *testing.T) {
	t.Parallel()
	var stdout, stderr bytes.Buffer
	if code := Main([]string{"version", "--output", "json"}, &stdout, &stderr, nil); code != startup.ExitOK {
		t.Fatalf("exit %d, want 0; stderr: %s", code, stderr.String())
	}
	var got map[string]any
	if err := json.Unmarshal(stdout.Bytes(), &got); err != nil {
		t.Fatalf("not JSON: %v\n%s", err, stdout.String())
	}
	want := map[string]any{
		"version":     "dev",
		"revision":    "unknown",
		"build_date":  "unknown",
		"go_version":  runtime.Version(),
		"platform":    runtime.GOOS + "/" + runtime.GOARCH,
		"development": true,
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("worker version --output json =\n%v\nwant\n%v", got, want)
	}
}

func TestVersionTextSaysDevelopmentBuild(t *testing.T) {
	t.Parallel()
	var stdout, stderr bytes.Buffer
	if code := Main([]string{"version"}, &stdout, &stderr, nil); code != startup.ExitOK {
		t.Fatalf("exit %d, want 0; stderr: %s", code, stderr.String())
	}
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	want := []string{
		"worker dev (development build)",
		"revision:   unknown",
		"built:      unknown",
		"go:         " + runtime.Version() + " " + runtime.GOOS + "/" + runtime.GOARCH,
	}
	if !slices.Equal(lines, want) {
		t.Errorf("worker version =\n%s\nwant\n%s", strings.Join(lines, "\n"), strings.Join(want, "\n"))
	}
}
