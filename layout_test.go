package worker

import (
	"os/exec"
	"strings"
	"testing"
)

// layoutRules are the import arrows the layout forbids: no package
// matching from may depend, directly or not, on a package matching
// forbidden. A pattern ending in "/..." matches the package and every
// package below it. Test files do not count: a test may cross a boundary
// to check both sides of it (an outbox sink's event through an inbox
// source).
var layoutRules = []struct {
	from, forbidden, why string
}{
	{"internal/inbox/...", "internal/outbox/...",
		"the inbox and its sources do not depend on the relay; what they share with the sinks is in internal/broker"},
	{"internal/broker/...", "internal/outbox/...",
		"a broker's wire convention serves both directions, so it knows neither"},
	{"internal/broker/...", "internal/inbox/...",
		"a broker's wire convention serves both directions, so it knows neither"},
}

// TestLayout checks layoutRules with go list -deps, as the build sees the
// packages.
func TestLayout(t *testing.T) {
	t.Parallel()
	const module = "github.com/worker-dev/worker/"
	for _, r := range layoutRules {
		out, err := exec.Command("go", "list", "-deps", "-f", `{{.ImportPath}}{{range .Deps}} {{.}}{{end}}`, "./"+r.from).Output()
		if err != nil {
			t.Fatalf("go list -deps ./%s: %v", r.from, err)
		}
		// Each line is a package and what it depends on; go list -deps
		// lists the packages matching from and every dependency of them.
		for line := range strings.Lines(string(out)) {
			pkg, deps, _ := strings.Cut(strings.TrimSpace(line), " ")
			if !matches(module+r.from, pkg) {
				continue
			}
			for dep := range strings.FieldsSeq(deps) {
				if matches(module+r.forbidden, dep) {
					t.Errorf("%s imports %s: %s", strings.TrimPrefix(pkg, module), strings.TrimPrefix(dep, module), r.why)
				}
			}
		}
	}
}

// matches reports whether the import path pkg matches pattern, where a
// trailing "/..." matches the path and everything below it.
func matches(pattern, pkg string) bool {
	if base, ok := strings.CutSuffix(pattern, "/..."); ok {
		return pkg == base || strings.HasPrefix(pkg, base+"/")
	}
	return pkg == pattern
}

// TestLayoutMatches: the check sees a forbidden import, and only one.
func TestLayoutMatches(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		pattern, pkg string
		want         bool
	}{
		{"a/internal/outbox/...", "a/internal/outbox", true},
		{"a/internal/outbox/...", "a/internal/outbox/sink/nats", true},
		{"a/internal/outbox/...", "a/internal/outboxes", false},
		{"a/internal/outbox", "a/internal/outbox/sink", false},
	} {
		if got := matches(c.pattern, c.pkg); got != c.want {
			t.Errorf("matches(%q, %q) = %v, want %v", c.pattern, c.pkg, got, c.want)
		}
	}
}
