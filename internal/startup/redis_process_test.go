package startup_test

import (
	"strings"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// lock.provider=redis at start: an unreachable Redis is retried for the
// connect budget, then exit 69; refused credentials exit 77 at once; the
// password shows nowhere.
func TestRedisAtStart(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name   string
		url    string
		code   int
		budget time.Duration
		says   string
	}{
		{"unreachable", "redis://:hunter2-secret@127.0.0.1:1/0", 69, 2 * time.Second, "xxxxx@127.0.0.1:1/0 unreachable after"},
		{"refused", "redis://nobody-here:hunter2-secret@" + strings.TrimPrefix(testkit.RedisURL(), "redis://"), 77, time.Minute, "authentication refused"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			db := pgtest.New(t)
			start := time.Now()
			p := startWorker(t, append([]string{
				"APP_DATABASE_URL=" + db.URL, "APP_MULTI_INSTANCE_ENABLED=true", "APP_LOCK_PROVIDER=redis",
				"APP_LOCK_REDIS_URL=" + c.url, "APP_DATABASE_CONNECT_TIMEOUT=" + c.budget.String(),
			}, replicaOnly...))
			if code := p.exitCode(t, 30*time.Second); code != c.code {
				t.Fatalf("exit %d, want %d:\n%s", code, c.code, p.out.String())
			}
			took := time.Since(start)
			out := p.out.String()
			if strings.Contains(out, "hunter2") || strings.Contains(out, "nobody-here") {
				t.Fatalf("credentials printed:\n%s", out)
			}
			if !strings.Contains(out, c.says) {
				t.Errorf("output does not say %q:\n%s", c.says, out)
			}
			if c.code == 69 && took < c.budget {
				t.Errorf("gave up after %s, before the %s budget was spent", took, c.budget)
			}
			if c.code == 77 && took > 20*time.Second {
				t.Errorf("refused credentials took %s: they must not be retried", took)
			}
		})
	}
}
