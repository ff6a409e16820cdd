package startup_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// writeConfig writes a YAML config file for a test and returns its env.
func writeConfig(t *testing.T, yaml string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "worker.yaml")
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	return "APP_CONFIG_FILE=" + path
}

// runCLI runs one worker command to its end and returns its exit code and
// its stdout and stderr apart.
func runCLI(t *testing.T, env []string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	cmd := exec.Command(workerBin, args...)
	// A command uses a connection or two: a small pool keeps the suite
	// within its share of the server (pgtest); env can still set another.
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "GORACE=atexit_sleep_ms=0", "APP_DATABASE_MAX_CONNS=2"}, env...)
	if usesTestDatabase(env) {
		defer pgtest.Reserve(t, workerConns(cmd.Env, args))()
	}
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	if _, ok := err.(*exec.ExitError); err != nil && !ok {
		t.Fatal(err)
	}
	return cmd.ProcessState.ExitCode(), out.String(), errOut.String()
}

func TestTasksCommandsEndToEnd(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	if _, err := db.Pool.Exec(context.Background(), "CREATE TABLE greeting (name text)"); err != nil {
		t.Fatal(err)
	}
	refuse := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusForbidden)
	}))
	t.Cleanup(refuse.Close)
	env := []string{"APP_DATABASE_URL=" + db.URL, "APP_OUTBOX_ENABLED=false", writeConfig(t, fmt.Sprintf(`
tasks:
  kinds:
    - name: greet
      type: sql
      sql: INSERT INTO greeting VALUES ($1->>'name')
    - name: forbidden
      type: http
      url: %s
`, refuse.URL))}
	cli := func(args ...string) string {
		t.Helper()
		code, out, errOut := runCLI(t, env, args...)
		if code != 0 {
			t.Fatalf("worker %v: exit %d\n%s%s", args, code, out, errOut)
		}
		return out
	}
	w := startWorker(t, env)
	w.waitReady(t, 15*time.Second)

	out := cli("tasks", "enqueue", "greet", "--args", `{"name": "ada"}`)
	m := regexp.MustCompile(`enqueued task (\d+)`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("enqueue printed %q", out)
	}
	greetID := m[1]
	testkit.Eventually(t, 10*time.Second, "the greet task to complete", func() bool {
		return strings.Contains(cli("tasks", "list", "--state", "completed", "--kind", "greet"), greetID)
	})

	var enq struct{ ID int64 }
	if err := json.Unmarshal([]byte(cli("tasks", "enqueue", "forbidden", "--output", "json")), &enq); err != nil || enq.ID == 0 {
		t.Fatalf("enqueue --output json: %v", err)
	}
	deadJSON := func() []map[string]any {
		var list []map[string]any
		if err := json.Unmarshal([]byte(cli("tasks", "dead", "list", "--output", "json")), &list); err != nil {
			t.Fatal(err)
		}
		return list
	}
	testkit.Eventually(t, 10*time.Second, "the forbidden task to be dead-lettered", func() bool {
		l := deadJSON()
		return len(l) == 1 && l[0]["id"] == float64(enq.ID) && l[0]["state"] == "cancelled"
	})
	if l := deadJSON(); l[0]["reason"] != "permanent_error" {
		t.Errorf("dead list: reason %v, want permanent_error", l[0]["reason"])
	}
	if out := cli("tasks", "dead", "list"); !strings.Contains(out, "forbidden") || !strings.Contains(out, "403") {
		t.Errorf("dead list:\n%s", out)
	}
	if out := cli("tasks", "retry", fmt.Sprint(enq.ID)); !strings.Contains(out, "available") {
		t.Errorf("retry:\n%s", out)
	}
	testkit.Eventually(t, 10*time.Second, "the retried task to be dead-lettered again", func() bool {
		l := deadJSON()
		return len(l) == 1 && l[0]["attempt"] == float64(2)
	})
	if out := cli("tasks", "retry", "--all-dead"); !strings.Contains(out, "retried 1 task(s)") {
		t.Errorf("retry --all-dead:\n%s", out)
	}

	// An operator's cancel is not a dead letter.
	var later int64
	if err := db.Pool.QueryRow(context.Background(), "SELECT worker_enqueue('greet', scheduled_at => now() + interval '1 hour')").Scan(&later); err != nil {
		t.Fatal(err)
	}
	if out := cli("tasks", "cancel", fmt.Sprint(later), "--output", "json"); !strings.Contains(out, `"state": "cancelled"`) {
		t.Errorf("cancel:\n%s", out)
	}
	testkit.Eventually(t, 10*time.Second, "the forbidden task back among the dead letters", func() bool { return len(deadJSON()) == 1 })
	for _, l := range deadJSON() {
		if l["id"] == float64(later) {
			t.Error("an operator-cancelled task is listed as a dead letter")
		}
	}
	// Both are cancelled, as River UI's Cancelled tab shows them; the
	// reason tells them apart.
	var cancelled []map[string]any
	if err := json.Unmarshal([]byte(cli("tasks", "list", "--state", "cancelled", "--output", "json")), &cancelled); err != nil {
		t.Fatal(err)
	}
	reasons := map[float64]any{}
	for _, l := range cancelled {
		reasons[l["id"].(float64)] = l["reason"]
	}
	if reasons[float64(later)] != "operator_cancel" || reasons[float64(enq.ID)] != "permanent_error" {
		t.Errorf("cancelled tasks' reasons: %v; want %d operator_cancel, %d permanent_error", reasons, later, enq.ID)
	}

	// River logs through the worker's JSON logger, never as text on stdout
	// (where the log sink writes events): Lines fails on a line that is not
	// JSON.
	w.out.Lines(t, "")

	for _, c := range []struct {
		args []string
		want int
	}{
		{[]string{"tasks", "retry", "987654"}, 66},
		{[]string{"tasks", "cancel", "987654"}, 66},
		{[]string{"tasks", "retry"}, 64},
		{[]string{"tasks", "enqueue", "greet", "--args", "[1"}, 64},
		{[]string{"tasks", "list", "--state", "lost"}, 64},
		{[]string{"tasks", "list", "--output", "xml"}, 64},
	} {
		if code, out, errOut := runCLI(t, env, c.args...); code != c.want {
			t.Errorf("worker %v: exit %d, want %d\n%s%s", c.args, code, c.want, out, errOut)
		}
	}
}

// A sql task's statement and its completion commit together, so killing
// the worker mid-task (SIGKILL, twice) neither loses a task's effect nor
// repeats it.
func TestSQLTaskEffectIsExactlyOnceAcrossSIGKILL(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE effect (n int)"); err != nil {
		t.Fatal(err)
	}
	const tasks = 40
	env := []string{"APP_DATABASE_URL=" + db.URL, "APP_OUTBOX_ENABLED=false",
		// A killed replica's running tasks are rescued this long after
		// their start, by whichever replica leads once its lease expires.
		"APP_TASKS_RESCUE_AFTER=3s", "APP_TASKS_TIMEOUT=2s",
		writeConfig(t, `
tasks:
  queues:
    default: {max_workers: 4, max_backlog: 1000}
  kinds:
    - name: effect
      type: sql
      timeout: 2s
      max_attempts: 10
      sql: INSERT INTO effect SELECT ($1->>'n')::int FROM pg_sleep(0.2)
`)}
	count := func(q string) int {
		var n int
		if err := db.Pool.QueryRow(ctx, q).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for i := range 2 {
		w := startWorker(t, env)
		if i == 0 {
			// Enqueued once a replica has published the kind's settings
			// (max_attempts 10: the kills cost attempts).
			w.waitReady(t, 15*time.Second)
			if _, err := db.Pool.Exec(ctx, "SELECT worker_enqueue('effect', jsonb_build_object('n', n)) FROM generate_series(1, $1) n", tasks); err != nil {
				t.Fatal(err)
			}
		}
		testkit.Eventually(t, 20*time.Second, "tasks running", func() bool {
			return count("SELECT count(*) FROM river_job WHERE state = 'running'") > 0
		})
		if err := w.cmd.Process.Kill(); err != nil {
			t.Fatal(err)
		}
		<-w.done
		t.Logf("kill %d: %d of %d tasks completed", i+1, count("SELECT count(*) FROM river_job WHERE state = 'completed'"), tasks)
	}
	startWorker(t, env)
	testkit.Eventually(t, 90*time.Second, "every task completed", func() bool {
		return count("SELECT count(*) FROM river_job WHERE state = 'completed'") == tasks
	})
	if n := count("SELECT count(*) FROM effect"); n != tasks {
		t.Errorf("%d effects for %d tasks", n, tasks)
	}
	if n := count("SELECT count(*) FROM (SELECT n FROM effect GROUP BY n HAVING count(*) <> 1) x"); n != 0 {
		t.Errorf("%d tasks took effect more than once", n)
	}
	if n := count("SELECT count(DISTINCT n) FROM effect"); n != tasks {
		t.Errorf("%d distinct effects, want %d", n, tasks)
	}
	// The kills hit tasks mid-run: those were rescued and run again.
	if n := count("SELECT count(*) FROM river_job WHERE attempt > 1"); n == 0 {
		t.Error("no task was interrupted by the kills; the test proved nothing")
	}
}

func TestTasksAndUIConfigErrorsExit78(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	cases := []struct {
		name string
		env  []string
		msg  string
	}{
		{"ui without password", []string{"APP_UI_ENABLED=true"}, "APP_UI_PASSWORD"},
		{"ui.addr not an address", []string{"APP_UI_ADDR=9091"}, `APP_UI_ADDR=\"9091\"; want host:port or :port`},
		{"ui.addr is http.addr", []string{"APP_UI_ADDR=127.0.0.1:0"}, `is APP_HTTP_ADDR too`},
		{"queue without workers", []string{writeConfig(t, "tasks:\n  queues:\n    mail: {max_workers: 0}\n")}, "tasks.queues.mail.max_workers"},
		{"unknown queue key", []string{writeConfig(t, "tasks:\n  queues:\n    mail: {workers: 3}\n")}, `tasks.queues.mail: unknown key`},
		{"kind of unknown type", []string{writeConfig(t, "tasks:\n  kinds:\n    - {name: export, type: ftp}\n")}, `tasks.kinds[0]`},
		{"kind in unknown queue", []string{writeConfig(t, "tasks:\n  kinds:\n    - {name: export, type: sql, sql: SELECT $1, queue: nope}\n")}, `is not under tasks.queues`},
		{"go kind without worker", []string{writeConfig(t, "tasks:\n  kinds:\n    - {name: resize, type: go}\n")}, "no Go worker is registered"},
		{"bad max attempts", []string{"APP_TASKS_MAX_ATTEMPTS=0"}, "APP_TASKS_MAX_ATTEMPTS=0"},
	}
	for _, c := range cases {
		code, out, errOut := runCLI(t, append([]string{"APP_DATABASE_URL=" + db.URL, "APP_HTTP_ADDR=127.0.0.1:0"}, c.env...))
		if code != 78 || !strings.Contains(errOut, c.msg) {
			t.Errorf("%s: exit %d, want 78 mentioning %q\n%s%s", c.name, code, c.msg, out, errOut)
		}
	}
}

// Only `run` serves the UI: an operator command reading the same
// configuration needs no UI password.
func TestOperatorCommandsNeedNoUIPassword(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	code, out, errOut := runCLI(t, []string{"APP_DATABASE_URL=" + db.URL, "APP_UI_ENABLED=true"}, "outbox", "stats")
	if code != 0 {
		t.Errorf("outbox stats with ui.enabled and no password: exit %d, want 0\n%s%s", code, out, errOut)
	}
}

func TestTasksListLimitBelowOneExits64(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"tasks", "list", "--limit", "0"}, {"tasks", "dead", "list", "--limit=-1"}} {
		code, out, errOut := runCLI(t, nil, args...)
		if code != 64 || !strings.Contains(errOut, "want at least 1") {
			t.Errorf("%v: exit %d, want 64 saying the limit is too small\n%s%s", args, code, out, errOut)
		}
	}
}

func TestRiverUIIsBehindBasicAuth(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	const password = "correct-horse-battery"
	env := []string{"APP_DATABASE_URL=" + db.URL, "APP_UI_ENABLED=true", "APP_UI_USERNAME=ops", "APP_UI_PASSWORD=" + password}
	w := startWorker(t, env)
	w.waitReady(t, 15*time.Second)

	get := func(path, user, pass string) int {
		req, _ := http.NewRequest(http.MethodGet, "http://"+w.addr+path, nil)
		if user != "" {
			req.SetBasicAuth(user, pass)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, path := range []string{"/riverui/", "/riverui/api/jobs?state=available"} {
		if code := get(path, "", ""); code != http.StatusUnauthorized {
			t.Errorf("%s without credentials: %d, want 401", path, code)
		}
		if code := get(path, "ops", "wrong"); code != http.StatusUnauthorized {
			t.Errorf("%s with a wrong password: %d, want 401", path, code)
		}
		if code := get(path, "admin", password); code != http.StatusUnauthorized {
			t.Errorf("%s with a wrong user: %d, want 401", path, code)
		}
		if code := get(path, "ops", password); code != http.StatusOK {
			t.Errorf("%s with the right credentials: %d, want 200", path, code)
		}
	}
	for _, path := range []string{"/metrics", "/livez", "/readyz"} {
		if code := get(path, "", ""); code != http.StatusOK {
			t.Errorf("%s without credentials: %d, want 200 (open)", path, code)
		}
	}
	_, printed, _ := runCLI(t, env, "config", "print")
	if strings.Contains(printed, password) || !strings.Contains(printed, "password: xxxxx") {
		t.Errorf("config print shows the UI password or no masked entry:\n%s", printed)
	}
	if !strings.Contains(printed, "max_workers: 10") {
		t.Errorf("config print does not show queues with their YAML keys:\n%s", printed)
	}
	if strings.Contains(w.out.String(), password) {
		t.Error("the UI password reached the log")
	}
}

// SIGTERM gives a running task the shutdown budget minus 1s, then cancels
// it; the worker exits 0 within the budget, and the task is handed back
// without using up its attempt, so the next replica runs it.
func TestShutdownHandsBackARunningTask(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	if _, err := db.Pool.Exec(ctx, "CREATE TABLE done (n int)"); err != nil {
		t.Fatal(err)
	}
	env := []string{"APP_DATABASE_URL=" + db.URL, "APP_OUTBOX_ENABLED=false", "APP_SHUTDOWN_TIMEOUT=3s",
		writeConfig(t, `
tasks:
  kinds:
    - name: slow
      type: sql
      max_attempts: 1
      sql: INSERT INTO done SELECT 1 FROM pg_sleep(($1->>'sleep')::float8)
`)}
	w := startWorker(t, env)
	w.waitReady(t, 15*time.Second)
	var id int64
	if err := db.Pool.QueryRow(ctx, `SELECT worker_enqueue('slow', '{"sleep": 60}')`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	state := func() (s string, attempt int) {
		if err := db.Pool.QueryRow(ctx, "SELECT state::text, attempt FROM river_job WHERE id = $1", id).Scan(&s, &attempt); err != nil {
			t.Fatal(err)
		}
		return s, attempt
	}
	testkit.Eventually(t, 10*time.Second, "the task running", func() bool { s, _ := state(); return s == "running" })
	sent := time.Now()
	if err := w.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := w.exitCode(t, 10*time.Second); code != 0 {
		t.Fatalf("exit %d after SIGTERM, want 0", code)
	}
	t.Logf("exited %s after SIGTERM with a 3s budget", w.exitAt.Sub(sent))
	if s, attempt := state(); s != "available" || attempt != 0 {
		t.Fatalf("after shutdown: %s, attempt %d; want available, attempt 0", s, attempt)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE river_job SET args = '{"sleep": 0}' WHERE id = $1`, id); err != nil {
		t.Fatal(err)
	}
	startWorker(t, env)
	testkit.Eventually(t, 15*time.Second, "the task completed by the next replica", func() bool { s, _ := state(); return s == "completed" })
}

// An enqueue into a queue at its max_backlog is refused: exit 75 with
// JOB_EXECUTOR_REJECTED, a state to retry later rather than an error.
func TestEnqueueIntoAFullQueueExits75(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	// What a replica with `default: {max_backlog: 1}` and a kind report
	// publishes at start.
	if _, err := db.Pool.Exec(context.Background(), "UPDATE worker_task_queue SET max_backlog = 1 WHERE queue = 'default'"); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(context.Background(), "INSERT INTO worker_task_kind VALUES ('report', 'default', 3)"); err != nil {
		t.Fatal(err)
	}
	env := []string{"APP_DATABASE_URL=" + db.URL}
	if code, out, errOut := runCLI(t, env, "tasks", "enqueue", "report"); code != 0 {
		t.Fatalf("first enqueue: exit %d\n%s%s", code, out, errOut)
	}
	code, out, errOut := runCLI(t, env, "tasks", "enqueue", "report")
	if code != 75 || !strings.Contains(errOut, "JOB_EXECUTOR_REJECTED") {
		t.Fatalf("enqueue into a full queue: exit %d, want 75 with JOB_EXECUTOR_REJECTED\n%s%s", code, out, errOut)
	}
}
