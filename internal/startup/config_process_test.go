package startup_test

import (
	"strings"
	"testing"
	"time"
)

// A misspelt setting, or a sink's settings while another sink is selected,
// stops the start with exit 78 before anything is published: with
// APP_OUTBOX_SINKK=webhook the worker used to run the log sink and mark
// every event published, which the webhook never received.
func TestMisspeltSinkSettingStopsTheStart(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		env  []string
		msg  string
	}{
		{"misspelt sink", []string{"APP_OUTBOX_SINKK=webhook", "APP_OUTBOX_WEBHOOK_URL=http://127.0.0.1:1/events"},
			`invalid configuration: APP_OUTBOX_SINKK is not a setting (did you mean APP_OUTBOX_SINK?); a variable within 2 edits of a setting's name stops the start`},
		{"webhook url with the log sink", []string{"APP_OUTBOX_WEBHOOK_URL=http://127.0.0.1:1/events"},
			`invalid configuration: APP_OUTBOX_WEBHOOK_URL is set, but outbox.sink=\"log\" (the default): the webhook sink's settings apply only with outbox.sink=webhook`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			p := startWorker(t, c.env)
			if code := p.exitCode(t, 30*time.Second); code != 78 {
				t.Fatalf("exit %d, want 78", code)
			}
			lines := checkLogLines(t, p.out.String())
			if len(lines) != 1 || lines[0]["msg"] != "exiting" || !strings.Contains(p.out.String(), c.msg) {
				t.Errorf("want one line saying %q:\n%s", c.msg, p.out.String())
			}
		})
	}
}

// With no APP_DATABASE_URL the worker uses a database of its own, worker,
// as scripts/worker does, and never the maintenance database postgres,
// which would receive the worker's and River's tables.
func TestDefaultDatabaseIsWorker(t *testing.T) {
	t.Parallel()
	code, stdout, stderr := runCLI(t, []string{writeConfig(t, "{}\n")}, "config", "print")
	if code != 0 {
		t.Fatalf("exit %d\n%s", code, stderr)
	}
	if !strings.Contains(stdout, "  url: postgres://xxxxx@127.0.0.1:5432/worker?xxxxx\n") {
		t.Errorf("the default database.url should name the database worker:\n%s", stdout)
	}
}
