package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/startup"
)

// A program's extensions are checked before the command line is read: a
// clash stops every command, even version, with exit 78.
func TestMainWithRefusesClashingExtensions(t *testing.T) {
	t.Parallel()
	var stdout, stderr bytes.Buffer
	ext := startup.Extensions{Sinks: map[string]func(context.Context) (outbox.Sink, error){outboxconfig.SinkWebhook: nil}}
	if code := MainWith(ext, []string{"version"}, &stdout, &stderr, nil); code != startup.ExitConfig ||
		!strings.HasPrefix(stderr.String(), "worker: ") || !strings.Contains(stderr.String(), `"webhook"`) {
		t.Fatalf("exit %d, stderr %q; want 78 naming the sink", code, stderr.String())
	}
	if stdout.Len() != 0 {
		t.Errorf("stdout %q; want nothing: the command must not run", stdout.String())
	}
}

// A command line mistake is one JSON log line, like every other failure,
// with exit 64 and a pointer to --help.
func TestUsageMistakeIsOneLogLine(t *testing.T) {
	t.Parallel()
	var stdout, stderr bytes.Buffer
	if code := Main([]string{"--frobnicate"}, &stdout, &stderr, nil); code != startup.ExitUsage {
		t.Fatalf("exit %d, want 64; stderr: %s", code, stderr.String())
	}
	lines := strings.Split(strings.TrimSpace(stderr.String()), "\n")
	var line struct {
		Msg      string `json:"msg"`
		Error    string `json:"error"`
		ExitCode int    `json:"exit_code"`
	}
	if len(lines) != 1 || json.Unmarshal([]byte(lines[0]), &line) != nil {
		t.Fatalf("stderr is not one JSON line:\n%s", stderr.String())
	}
	if line.Msg != "exiting" || line.ExitCode != startup.ExitUsage || !strings.Contains(line.Error, "frobnicate") ||
		!strings.Contains(line.Error, "see worker --help") {
		t.Errorf("log line %+v; want exiting, exit_code 64, the flag and a pointer to --help", line)
	}
}

// --help is not a failure: exit 0, the usage on stdout.
func TestHelpExitsZero(t *testing.T) {
	t.Parallel()
	var stdout, stderr bytes.Buffer
	if code := Main([]string{"--help"}, &stdout, &stderr, nil); code != startup.ExitOK {
		t.Fatalf("exit %d, want 0; stderr: %s", code, stderr.String())
	}
	if !strings.Contains(stdout.String(), "Usage: worker") {
		t.Errorf("stdout does not show the usage:\n%s", stdout.String())
	}
}

// checkJSONArg refuses what PostgreSQL's jsonb would refuse later, as the
// operator's mistake (exit 64).
func TestCheckJSONArg(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		value  string
		object bool
		want   string // "" for accepted
	}{
		{`{}`, true, ""},
		{`{"a":[1,"x"]}`, true, ""},
		{`[1]`, false, ""},
		{`[1]`, true, "not a JSON object"},
		{`{`, false, "not valid JSON"},
		{`1 2`, false, "not valid JSON"},
		{`{"a":"x\u0000y"}`, true, "NUL"},
	} {
		err := checkJSONArg("--args", c.value, c.object)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("checkJSONArg(%q, %v) = %v; want accepted", c.value, c.object, err)
		case c.want != "" && (exitCode(err) != startup.ExitUsage || !strings.Contains(err.Error(), c.want)):
			t.Errorf("checkJSONArg(%q, %v) = %v; want exit 64 saying %q", c.value, c.object, err, c.want)
		}
	}
}
