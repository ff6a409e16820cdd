package startup_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/worker-dev/worker/internal/startup"
)

// A source's own section is checked with the configuration: a webhook
// source without a secret is exit 78 naming the entry, not a failure at
// start.
func TestInboxSourceSectionIsCheckedWithTheConfiguration(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "worker.yaml")
	if err := os.WriteFile(path, []byte(`inbox:
  sources:
    - {name: orders, kind: webhook, handler: {kind: sql, sql: "SELECT 1"}}
`), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := startup.LoadConfig(path, nil)
	if code := startup.ExitCode(err); code != startup.ExitConfig || !strings.Contains(err.Error(), "inbox.sources[0] (orders)") ||
		!strings.Contains(err.Error(), "secret") {
		t.Errorf("exit %d: %v; want 78 naming inbox.sources[0] and its secret", code, err)
	}
}
