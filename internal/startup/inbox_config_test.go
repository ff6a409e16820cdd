package startup_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/worker-dev/worker/internal/startup"
)

// A source of a kind this build does not have is a configuration error
// naming the entry, not a crash at start.
func TestInboxSourceOfAKindNotBuiltIn(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "worker.yaml")
	if err := os.WriteFile(path, []byte(`inbox:
  sources:
    - {name: orders, kind: webhook, handler: {kind: sql, sql: "SELECT 1"}}
`), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := startup.LoadConfig(path, nil)
	if err == nil {
		t.Skip("this build has a webhook source")
	}
	if code := startup.ExitCode(err); code != startup.ExitConfig || !strings.Contains(err.Error(), `inbox.sources[0].kind="webhook"`) {
		t.Errorf("exit %d: %v; want 78 naming inbox.sources[0].kind", code, err)
	}
}
