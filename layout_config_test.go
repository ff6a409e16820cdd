package worker

import (
	"os/exec"
	"strings"
	"testing"
)

// layoutRules are imports a package must not have. With deps, the rule
// holds for everything the package pulls in (go list -deps); without, for
// the package's own imports: the configuration reads types that live
// beside their PostgreSQL code (outbox.Config, jobs.Definition), so pgx
// reaches it through them, but it must never parse, connect or build a
// part itself.
var layoutRules = []struct {
	pkg       string
	deps      bool
	forbidden []string // import path prefixes
	why       string
}{
	{
		pkg:  "./internal/config",
		deps: true,
		forbidden: []string{
			"github.com/worker-dev/worker/internal/outbox/sink",
			"github.com/worker-dev/worker/internal/inbox/source",
			"github.com/worker-dev/worker/internal/startup",
			"github.com/nats-io/",
			"github.com/rabbitmq/",
			"github.com/twmb/franz-go",
		},
		why: "configuration is read and checked without the sinks, sources or broker clients; startup builds them",
	},
	{
		pkg:       "./internal/config",
		forbidden: []string{"github.com/jackc/pgx", "github.com/redis/go-redis"},
		why:       "configuration neither connects nor parses URLs with a driver: the caller passes such checks in (config.Options)",
	},
}

func TestLayoutConfig(t *testing.T) {
	t.Parallel()
	for _, r := range layoutRules {
		format := "{{join .Imports \"\\n\"}}"
		args := []string{"list", "-f", format, r.pkg}
		if r.deps {
			args = []string{"list", "-deps", r.pkg}
		}
		out, err := exec.Command("go", args...).CombinedOutput()
		if err != nil {
			t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		for _, imp := range strings.Fields(string(out)) {
			for _, f := range r.forbidden {
				if strings.HasPrefix(imp, f) {
					t.Errorf("%s imports %s (deps: %v): %s", r.pkg, imp, r.deps, r.why)
				}
			}
		}
	}
}
