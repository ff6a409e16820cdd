package config_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/startup"
)

// Every duration setting has a bound in code, validation refuses a value
// just below it (naming the setting), and docs/configuration.md states it
// in the setting's row: "positive", "at least `1m`" or "longer than `1s`".
func TestDurationBoundsAreDocumented(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../../docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	rows := map[string]string{}
	for line := range strings.SplitSeq(string(doc), "\n") {
		if cells := strings.Split(line, " | "); len(cells) > 1 && strings.HasPrefix(line, "| `APP_") {
			rows[strings.Trim(cells[0], "| `")] = line
		}
	}
	for _, s := range config.DurationSettings() {
		if !s.Bounded {
			t.Errorf("%s: a duration setting without a bound in code (DurationMinimums, ownDurationBounds)", s.Key)
			continue
		}
		if row := rows[s.Env]; !strings.Contains(row, s.Doc) {
			t.Errorf("%s: its row in docs/configuration.md does not say %q:\n%s", s.Env, s.Doc, row)
		}
		env := append(sinkFor(s.Key), s.Env+"="+s.Below.String())
		// Loaded as run loads it: a sink's section is checked by the sink.
		if _, err := startup.LoadConfig(writeFile(t, "{}"), env); err == nil || !strings.Contains(err.Error(), s.Env+"="+s.Below.String()) {
			t.Errorf("%s=%s: LoadConfig = %v, want a refusal that names it", s.Env, s.Below, err)
		}
	}
}

// sinkFor selects the sink whose section key belongs to: its keys are
// checked only when it is the sink.
func sinkFor(key string) []string {
	for _, sink := range []string{"webhook", "nats", "rabbitmq", "kafka"} {
		if strings.HasPrefix(key, "outbox."+sink+".") {
			env := []string{"APP_OUTBOX_SINK=" + sink}
			if sink == "webhook" {
				env = append(env, "APP_OUTBOX_WEBHOOK_URL=http://127.0.0.1:1/hook")
			}
			return env
		}
	}
	return nil
}

func writeFile(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "worker.yaml")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}
