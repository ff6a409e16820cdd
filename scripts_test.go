package worker

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
)

// The README's first command, scripts/worker, in a scratch copy of the
// repository and on a database of the test's own: it says it is building
// and how long that took, then prints on stdout the demo's two events as
// the README shows them, and stops with exit 0 on Ctrl-C (SIGINT).
func TestQuickStartScript(t *testing.T) {
	t.Parallel()
	want := quickStartEvents(t)
	dir := scratchCopy(t)
	// The demo's worker on a pool of 2, with the probe's, the outbox
	// listener and River's 5 (the demo runs a task).
	const conns = 2 + 1 + 1 + 5
	pgtest.Need(t, pgtest.PoolConns+conns)
	db := pgtest.NewEmpty(t)
	dbURL, release := db.ChildURL(t, 2, conns-2)
	defer release()
	cmd := exec.Command("scripts/worker")
	cmd.Dir = dir
	cmd.Env = append(withoutAppEnv(os.Environ()),
		"APP_DATABASE_URL="+dbURL,
		"APP_DATABASE_MAX_CONNS=2",
		"APP_HTTP_ADDR=127.0.0.1:0",
		"GOFLAGS=-trimpath", // reuse the build cache of other builds of this checkout
		"TMPDIR="+t.TempDir(),
	)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr lockedBuffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	defer func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
		if t.Failed() {
			t.Logf("scripts/worker's stderr:\n%s", stderr.String())
		}
	}()
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		done <- cmd.Wait()
	}()

	// The first build of this checkout may take minutes on a busy machine;
	// the README's "within 5 seconds" counts from the build's end.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	seen := map[string]bool{} // event_type of each wanted event seen
	var printed []string
	var builtAt time.Time
	tick := time.NewTicker(50 * time.Millisecond) // to see when the build ends
	defer tick.Stop()
	for len(seen) < len(want) {
		select {
		case <-tick.C:
		case line, ok := <-lines:
			if !ok {
				t.Fatalf("scripts/worker's stdout ended before the demo's events: %v\n%s", <-done, strings.Join(printed, "\n"))
			}
			printed = append(printed, line)
			for _, w := range want {
				if matchOutput(w.line, line) {
					seen[w.eventType] = true
				}
			}
		case <-ctx.Done():
			t.Fatalf("within 5 minutes of the start, scripts/worker printed no line like each of\n%s\nbut\n%s",
				wantLines(want), strings.Join(printed, "\n"))
		}
		if builtAt.IsZero() && strings.Contains(stderr.String(), "built in ") {
			builtAt = time.Now()
		}
	}
	if builtAt.IsZero() {
		t.Error(`no "built in …s" line on stderr before the events`)
	} else if took := time.Since(builtAt); took > 15*time.Second {
		t.Errorf("the demo's events came %s after the build; the README says within 5 seconds", took.Round(100*time.Millisecond))
	} else {
		t.Logf("both demo events %s after the build (the README says within 5 seconds)", took.Round(100*time.Millisecond))
	}
	log := stderr.String()
	if !strings.Contains(log, "building the worker (first run: about a minute)\n") {
		t.Error(`stderr lacks "building the worker (first run: about a minute)" before the build`)
	}
	if err := syscall.Kill(cmd.Process.Pid, syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		done <- err // for the deferred wait
		if err != nil {
			t.Errorf("after Ctrl-C (SIGINT): %v, want exit 0", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("scripts/worker still running 30s after SIGINT")
	}
}

type demoEvent struct{ eventType, line string }

func wantLines(events []demoEvent) string {
	var lines []string
	for _, e := range events {
		lines = append(lines, e.line)
	}
	return strings.Join(lines, "\n")
}

// quickStartEvents are the lines of the README's quick start's ```json
// block: the demo's events as they are printed, "…" standing for what
// varies.
func quickStartEvents(t *testing.T) []demoEvent {
	t.Helper()
	_, quick, _ := strings.Cut(readText(t, "README.md"), "## Quick start\n")
	_, block, ok := strings.Cut(quick, "```json\n")
	block, _, _ = strings.Cut(block, "```")
	var out []demoEvent
	for _, line := range strings.Split(strings.TrimSpace(block), "\n") {
		var e struct {
			EventType string `json:"event_type"`
		}
		if err := json.Unmarshal([]byte(line), &e); err != nil || e.EventType == "" {
			t.Fatalf("README.md quick start: %q is not an event (%v)", line, err)
		}
		out = append(out, demoEvent{e.EventType, line})
	}
	if !ok || len(out) == 0 {
		t.Fatal("README.md's quick start shows no ```json events")
	}
	return out
}

// scripts/worker logs in to the local PostgreSQL with psql -w, which
// never prompts: where that login needs a password it has not got, the
// script stops with exit 1 and says what it needs. The local server here
// trusts local logins, so a psql on PATH before the real one answers as
// such a server does (it records its arguments, for the -w).
func TestWorkerScriptStopsWhereAPasswordIsNeeded(t *testing.T) {
	t.Parallel()
	bin := t.TempDir()
	argsFile := filepath.Join(bin, "psql.args")
	fake := "#!/bin/sh\nprintf '%s\\n' \"$@\" > " + argsFile + "\n" +
		"echo 'psql: error: connection to server at \"127.0.0.1\", port 5432 failed: fe_sendauth: no password supplied' >&2\nexit 2\n"
	if err := os.WriteFile(filepath.Join(bin, "psql"), []byte(fake), 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "scripts/worker")
	cmd.Env = append(withoutAppEnv(os.Environ()), "PATH="+bin+string(os.PathListSeparator)+os.Getenv("PATH"))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err := cmd.Run()
	if code := cmd.ProcessState.ExitCode(); code != 1 {
		t.Fatalf("exit %d (%v), want 1:\n%s", code, err, stderr.String())
	}
	for _, want := range []string{
		"cannot log in to PostgreSQL on 127.0.0.1:5432 as postgres: psql: error:",
		"fe_sendauth: no password supplied",
		"PGPASSWORD or ~/.pgpass",
		"APP_DATABASE_URL",
	} {
		if !strings.Contains(stderr.String(), want) {
			t.Errorf("stderr lacks %q:\n%s", want, stderr.String())
		}
	}
	if strings.Contains(stderr.String(), "building the worker") {
		t.Error("the script went on to build the worker")
	}
	args, err := os.ReadFile(argsFile)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains("\n"+string(args), "\n-w\n") {
		t.Errorf("psql ran without -w, so it may prompt for a password: %q", args)
	}
}

// lockedBuffer is a bytes.Buffer that a process writes while the test
// reads it.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
