package startup

import (
	"bytes"
	"encoding/json"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"testing"
)

// Scripts read `worker version --output json`: its keys and their types are
// a contract (docs/operations.md), so a renamed or dropped key fails here.
func TestVersionJSONShape(t *testing.T) {
	t.Parallel()
	var stdout, stderr bytes.Buffer
	if code := Main([]string{"version", "--output", "json"}, &stdout, &stderr, nil); code != ExitOK {
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
	if code := Main([]string{"version"}, &stdout, &stderr, nil); code != ExitOK {
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

func TestIsRelease(t *testing.T) {
	t.Parallel()
	for v, want := range map[string]bool{
		"v0.1.0":                               true,
		"v1.4.2":                               true,
		"1.4.2":                                true,
		"v0.2.0-rc.1":                          true,
		"dev":                                  false,
		"":                                     false,
		"v0.1.0-dev":                           false,
		"v0.2.0-dev+e573868":                   false,
		"v0.1.0+dirty":                         false,
		"v0.0.0-20261206063516-e573868abcd1":   false,
		"v0.1.1-0.20261206063516-e573868abcd1": false,
		"v0.2.0-rc.1.0.20261206063516-e573868abcd1": false,
		"(devel)": false,
		"v01.2.3": false,
	} {
		if got := isRelease(v); got != want {
			t.Errorf("isRelease(%q) = %v, want %v", v, got, want)
		}
	}
}
