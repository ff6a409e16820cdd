package startup_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

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

// A source's keys come from its YAML entry over inboxconfig.DefaultSource, and
// from APP_INBOX_SOURCES_<NAME>_<KEY>, which keeps secrets out of the file;
// `config print` and the logs mask them, and a variable that names no key
// stops the start.
func TestInboxSourceKeysFromTheEnvironment(t *testing.T) {
	t.Parallel()
	const password = "inbox-nats-pw-never-shown"
	path := filepath.Join(t.TempDir(), "worker.yaml")
	if err := os.WriteFile(path, []byte(`inbox:
  sources:
    - name: order-events
      kind: nats
      nats: {url: "nats://127.0.0.1:4222", consumer: shop, user: shop}
      handler: {kind: sql, sql: "SELECT 1"}
`), 0o600); err != nil {
		t.Fatal(err)
	}
	env := []string{"APP_INBOX_SOURCES_ORDER_EVENTS_NATS_PASSWORD=" + password, "APP_INBOX_SOURCES_ORDER_EVENTS_NATS_ACK_WAIT=90s"}
	cfg, err := startup.LoadConfig(path, env)
	if err != nil {
		t.Fatal(err)
	}
	src := cfg.Inbox.Sources[0]
	if src.NATS.Password != password || src.NATS.AckWait != 90*time.Second || src.NATS.Stream != "OUTBOX" || src.NATS.User != "shop" {
		t.Errorf("source %+v: want the password and ack_wait from the environment, the stream's default, the user from the file", src.NATS)
	}
	code, stdout, stderr := runCLI(t, append(env, "APP_CONFIG_FILE="+path), "config", "print")
	if code != 0 || strings.Contains(stdout+stderr, password) || !strings.Contains(stdout, "password: xxxxx") {
		t.Errorf("config print exit %d shows the password or does not mask it:\n%s%s", code, stdout, stderr)
	}
	_, err = startup.LoadConfig(path, []string{"APP_INBOX_SOURCES_ORDER_EVENTS_NATS_PASWORD=x"})
	if code := startup.ExitCode(err); code != startup.ExitConfig || !strings.Contains(fmt.Sprint(err), "APP_INBOX_SOURCES_ORDER_EVENTS_NATS_PASWORD") {
		t.Errorf("a misspelt source variable: exit %d, %v; want 78 naming it", code, err)
	}
}
