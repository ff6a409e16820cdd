package startup_test

import (
	"context"
	"encoding/json"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/tasks/tasksconfig"
)

// checkLogLines fails unless every line of out is a JSON log line naming
// its instance.
func checkLogLines(t *testing.T, out string) []map[string]any {
	t.Helper()
	var lines []map[string]any
	for l := range strings.SplitSeq(strings.TrimSpace(out), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("not a JSON log line: %s", l)
		}
		if id, _ := m["instance_id"].(string); id == "" {
			t.Errorf("log line without instance_id: %s", l)
		}
		lines = append(lines, m)
	}
	return lines
}

// docs/operations.md: instance_id on every line, the first line is "worker
// starting", and an APP_* variable like a setting is warned about. Ctrl-C (SIGINT)
// stops the worker with exit 0, as SIGTERM does: `go run` exiting 1 after
// Ctrl-C is go run's own doing (golang/go#40467).
func TestRunLogsStartupFirstAndEveryLineNamesItsInstance(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, "APP_LOCK_LEASE_TTL_SECONDS=5", "APP_LOG_LEVEL=info"})
	p.waitReady(t, 15*time.Second)
	if err := p.cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	if code := p.exitCode(t, 10*time.Second); code != 0 {
		t.Fatalf("exit %d after SIGINT, want 0", code)
	}
	lines := checkLogLines(t, p.out.String())
	if lines[0]["msg"] != "worker starting" {
		t.Errorf("first line: %v; want worker starting", lines[0])
	}
	// The harness's pool of 5, the probe's, the outbox listener and River's
	// 5: what an operator sizes max_connections by.
	if got := lines[0]["db_conns_max"]; got != float64(12) {
		t.Errorf("worker starting: db_conns_max %v, want 12", got)
	}
	if msg, _ := lines[1]["msg"].(string); !strings.Contains(msg, "APP_LOCK_LEASE_TTL_SECONDS is not a setting") || lines[1]["level"] != "WARN" {
		t.Errorf("second line: %v; want the warning about APP_LOCK_LEASE_TTL_SECONDS", lines[1])
	}
}

// Commands that stop at once, on their configuration or their arguments,
// say why in one log line that names the instance too (derived, as run
// derives it, when none is set).
func TestExitLinesNameTheInstance(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		env  []string
		args []string
		want int
		msg  string
	}{
		{"config error", []string{"APP_LOCK_WAIT_TIME=banana"}, nil, 78, "APP_LOCK_WAIT_TIME"},
		{"config error, instance from the environment", []string{"APP_LOCK_WAIT_TIME=banana", "APP_INSTANCE_ID=replica-7"}, nil, 78, "replica-7"},
		{"unknown flag", nil, []string{"--frobnicate"}, 64, "see worker --help"},
		{"unknown flag, instance from the file", []string{writeConfig(t, "instance: {id: from-file}\n")}, []string{"--frobnicate"}, 64, `"instance_id":"from-file"`},
		{"bad argument", nil, []string{"outbox", "dead", "list", "--limit", "0"}, 64, "--limit 0"},
		{"healthcheck with a zero timeout", nil, []string{"healthcheck", "--timeout", "0s"}, 64, "--timeout 0s: want a positive duration"},
		{"healthcheck with a negative timeout", nil, []string{"healthcheck", "--timeout=-1s"}, 64, "--timeout -1s: want a positive duration"},
		{"task kind name River rejects", []string{writeConfig(t, "tasks:\n  kinds:\n    - {name: a, type: sql, sql: SELECT 1}\n")}, nil, 78, tasksconfig.KindNameRule},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			code, stdout, stderr := runCLI(t, c.env, c.args...)
			if code != c.want {
				t.Fatalf("exit %d, want %d\n%s%s", code, c.want, stdout, stderr)
			}
			lines := checkLogLines(t, stderr)
			if len(lines) != 1 || !strings.Contains(stderr, c.msg) {
				t.Errorf("want one line mentioning %q:\n%s", c.msg, stderr)
			}
		})
	}
}

// config print warns about a variable like a setting, as run does, on
// stderr: stdout stays the YAML.
func TestConfigPrintWarnsAboutAVariableLikeASetting(t *testing.T) {
	t.Parallel()
	code, stdout, stderr := runCLI(t, []string{"APP_OUTBOX_BATCH_SIZE_MAX=10", writeConfig(t, "{}\n")}, "config", "print")
	if code != 0 {
		t.Fatalf("exit %d\n%s", code, stderr)
	}
	var printed map[string]any
	if err := yaml.Unmarshal([]byte(stdout), &printed); err != nil || printed["outbox"] == nil {
		t.Fatalf("stdout is not the configuration (%v):\n%s", err, stdout)
	}
	lines := checkLogLines(t, stderr)
	if len(lines) != 1 || !strings.Contains(stderr, "APP_OUTBOX_BATCH_SIZE_MAX is not a setting and is ignored (did you mean APP_OUTBOX_BATCH_SIZE?)") {
		t.Errorf("want the warning on stderr:\n%s", stderr)
	}
}

// Several bad jobs are reported together; a YAML syntax error names the
// line it is on.
func TestConfigErrorsNameEveryBadJobAndTheRightLine(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, yaml string
		want       []string
	}{
		{"unknown keys", `jobs:
  - {name: a, kind: sql, sql: SELECT 1, dealy: 1s}
  - {name: b, kind: sql, sql: SELECT 1, delay: 1s, timeuot: 1s}
  - {name: c, kind: sql, sql: SELECT 1, delay: 10}
`, []string{`:2: jobs[0] \"a\": unknown key \"dealy\"`, `:3: jobs[1] \"b\": unknown key \"timeuot\"`, `:4: jobs[2] \"c\": delay=10 is not a duration`}},
		{"bad values", `jobs:
  - {name: a, kind: sql, sql: SELECT 1}
  - {name: b, kind: http, delay: 1s}
  - {name: outbox-partitions, kind: sql, sql: SELECT 1, delay: 1s}
`, []string{`jobs[0] \"a\": delay`, `jobs[1] \"b\": url`, `jobs[2] \"outbox-partitions\": name is taken`}},
		{"syntax error on line 3", "log:\n  level: info\n\tformat: json\n", []string{".yaml:3:1: "}},
		{"sequence item in a mapping on line 3", "a: 1\nb: 2\n- c\n", []string{".yaml:3:1: "}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			code, _, stderr := runCLI(t, []string{writeConfig(t, c.yaml)}, "config", "print")
			if code != 78 {
				t.Fatalf("exit %d, want 78\n%s", code, stderr)
			}
			checkLogLines(t, stderr)
			for _, w := range c.want {
				if !strings.Contains(stderr, w) {
					t.Errorf("message lacks %q:\n%s", w, stderr)
				}
			}
		})
	}
}

// tasks enqueue and outbox emit refuse what the database could not store
// or no replica would run as the operator's mistake (64), never as an
// internal error (70).
func TestEnqueueAndEmitRefuseBadArguments(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	// A replica running the Go kind published-kind has published it.
	if _, err := db.Pool.Exec(context.Background(), "INSERT INTO worker_task_kind VALUES ('published-kind', 'default', 3)"); err != nil {
		t.Fatal(err)
	}
	env := []string{"APP_DATABASE_URL=" + db.URL, writeConfig(t, "tasks:\n  kinds:\n    - {name: configured, type: sql, sql: SELECT 1}\n")}
	long := strings.Repeat("k", 100_000)
	cases := []struct {
		args []string
		want int
		msg  string
	}{
		{[]string{"tasks", "enqueue", ""}, 64, tasksconfig.KindNameRule},
		{[]string{"tasks", "enqueue", long}, 64, tasksconfig.KindNameRule},
		{[]string{"tasks", "enqueue", "configured", "--args", `{"a": "x\u0000y"}`}, 64, `--args holds \\u0000`},
		{[]string{"tasks", "enqueue", "configured", "--args", `{"x\u0000": 1}`}, 64, `--args holds \\u0000`},
		{[]string{"outbox", "emit", "--aggregate-type", "a", "--aggregate-id", "1", "--event-type", "e", "--payload", `["\u0000"]`}, 64, `--payload holds \\u0000`},
		{[]string{"tasks", "enqueue", "nobody-runs-this"}, 64, "--allow-unknown-kind"},
		{[]string{"tasks", "enqueue", "nobody-runs-this", "--allow-unknown-kind"}, 0, ""},
		{[]string{"tasks", "enqueue", "configured", "--args", `{"a": "\\u0000 is text here"}`}, 0, ""},
		{[]string{"tasks", "enqueue", "published-kind"}, 0, ""},
	}
	for _, c := range cases {
		code, stdout, stderr := runCLI(t, env, c.args...)
		shown := strings.ReplaceAll(strings.Join(c.args, " "), long, "<100000 characters>")
		if code != c.want || !strings.Contains(stderr, c.msg) {
			t.Errorf("worker %s: exit %d, want %d mentioning %q\n%s%s", shown, code, c.want, c.msg, stdout, stderr)
		}
		if strings.Contains(stderr, long) {
			t.Errorf("worker %s: the message repeats the whole kind", shown)
		}
	}
	var waiting int
	if err := db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM river_job").Scan(&waiting); err != nil || waiting != 3 {
		t.Errorf("%d tasks stored (%v); want the 3 accepted", waiting, err)
	}
}
