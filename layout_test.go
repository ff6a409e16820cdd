package worker

import (
	"os/exec"
	"strings"
	"testing"
)

// layoutRules are the import arrows the layout forbids: no package
// matching from may depend on a package matching one of forbidden. The
// rule holds for everything the package pulls in (go list -deps), or with
// direct for its own imports only. A pattern is relative to the module
// when it starts with "internal/", and ending in "/..." it matches the
// package and every package below it; any other pattern is an import path
// prefix (a third-party module). Test files do not count: a test may cross
// a boundary to check both sides of it (an outbox sink's event through an
// inbox source).
var layoutRules = []struct {
	from      string
	forbidden []string
	direct    bool
	why       string
}{
	{"internal/inbox/...", []string{"internal/outbox/..."}, false,
		"the inbox and its sources do not depend on the relay; what they share with the sinks is in internal/broker"},
	{"internal/broker/...", []string{"internal/outbox/...", "internal/inbox/..."}, false,
		"a broker's wire convention serves both directions, so it knows neither"},
	{"internal/config", []string{
		"internal/outbox", "internal/inbox", "internal/tasks", "internal/jobs", "internal/lock",
		"internal/outbox/sink/...", "internal/inbox/source/...", "internal/startup",
		"github.com/jackc/pgx", "github.com/redis/go-redis", "github.com/riverqueue/",
		"github.com/nats-io/", "github.com/rabbitmq/", "github.com/twmb/franz-go",
	}, false,
		"configuration is read and checked from the parts' settings packages (outboxconfig, inboxconfig, tasksconfig, jobsconfig) alone: " +
			"no driver, client or part is built, or even linked, to read a file"},
	// Go refuses the import cycle anyway; the rule says why, and keeps
	// argument parsing (kong) out of the wiring as well.
	{"internal/startup", []string{"internal/cli", "github.com/alecthomas/kong"}, false,
		"the command line calls the wiring, never the other way: startup runs the parts whoever parsed the arguments"},
	// The commands reach the adapters through startup (run, migrate, the
	// configuration check builds each part once); startup stays their one
	// importer.
	{"internal/cli", []string{
		"internal/outbox/sink/...", "internal/inbox/source/...", "internal/broker/...", "internal/lock",
		"github.com/nats-io/", "github.com/rabbitmq/", "github.com/twmb/franz-go", "github.com/redis/go-redis",
	}, true,
		"the operator commands do not build sinks, sources or lock providers; startup wires them"},
}

const module = "github.com/worker-dev/worker/"

// TestLayout checks layoutRules with go list, as the build sees the
// packages.
func TestLayout(t *testing.T) {
	t.Parallel()
	for _, r := range layoutRules {
		list := "{{range .Deps}} {{.}}{{end}}"
		if r.direct {
			list = "{{range .Imports}} {{.}}{{end}}"
		}
		args := []string{"list", "-deps", "-f", "{{.ImportPath}}" + list, "./" + r.from}
		out, err := exec.Command("go", args...).Output()
		if err != nil {
			t.Fatalf("go %s: %v", strings.Join(args, " "), err)
		}
		// Each line is a package and what it depends on; go list -deps
		// lists the packages matching from and every dependency of them.
		for line := range strings.Lines(string(out)) {
			pkg, deps, _ := strings.Cut(strings.TrimSpace(line), " ")
			if !matches(r.from, pkg) {
				continue
			}
			for dep := range strings.FieldsSeq(deps) {
				for _, f := range r.forbidden {
					if matches(f, dep) {
						t.Errorf("%s imports %s: %s", strings.TrimPrefix(pkg, module), strings.TrimPrefix(dep, module), r.why)
					}
				}
			}
		}
	}
}

// matches reports whether the import path pkg matches pattern (see
// layoutRules).
func matches(pattern, pkg string) bool {
	if !strings.HasPrefix(pattern, "internal/") {
		return strings.HasPrefix(pkg, pattern)
	}
	if base, ok := strings.CutSuffix(module+pattern, "/..."); ok {
		return pkg == base || strings.HasPrefix(pkg, base+"/")
	}
	return pkg == module+pattern
}

// TestLayoutMatches: the check sees a forbidden import, and only one.
func TestLayoutMatches(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		pattern, pkg string
		want         bool
	}{
		{"internal/outbox/...", module + "internal/outbox", true},
		{"internal/outbox/...", module + "internal/outbox/sink/nats", true},
		{"internal/outbox/...", module + "internal/outboxes", false},
		{"internal/outbox", module + "internal/outbox/sink", false},
		{"github.com/jackc/pgx", "github.com/jackc/pgx/v5/pgxpool", true},
		{"github.com/jackc/pgx", module + "internal/outbox", false},
	} {
		if got := matches(c.pattern, c.pkg); got != c.want {
			t.Errorf("matches(%q, %q) = %v, want %v", c.pattern, c.pkg, got, c.want)
		}
	}
}
