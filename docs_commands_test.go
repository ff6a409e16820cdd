package worker

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
)

// shellBlock is one ```sh (or bash, shell, console) block of README.md or
// docs/, as docs/testing.md describes: run by TestShellBlocks, or marked
// as not run.
type shellBlock struct {
	page   string // relative to the repository's root
	line   int    // of the opening fence
	script string
	notRun string // the marker's reason; "" for a block that runs
	output string // the ```text block right after it: what it prints
	hasOut bool
}

var shellLangs = map[string]bool{"sh": true, "bash": true, "shell": true, "console": true}

// notRunMarker is the line before a block that is not run, with its reason.
var notRunMarker = regexp.MustCompile(`^<!--\s*not run:\s*(.*?)\s*-->$`)

// shellBlocks returns the shell blocks of README.md and docs/**/*.md.
func shellBlocks(t *testing.T) []shellBlock {
	t.Helper()
	pages := []string{"README.md"}
	err := filepath.WalkDir("docs", func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(p, ".md") {
			pages = append(pages, p)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	var blocks []shellBlock
	for _, p := range pages {
		blocks = append(blocks, pageShellBlocks(t, p)...)
	}
	return blocks
}

// pageShellBlocks parses one page's fenced blocks, without their fence's
// indent (a block in a list item is indented), and keeps the shell ones
// with their marker and their output block.
func pageShellBlocks(t *testing.T, page string) []shellBlock {
	t.Helper()
	lines := strings.Split(readText(t, page), "\n")
	var blocks []shellBlock
	var cur *shellBlock
	var body []string
	fence, indent, lang := "", "", ""
	lastEnd := -1 // the line after the last shell block's closing fence
	for i, line := range lines {
		trimmed := strings.TrimSpace(line)
		switch {
		case fence == "" && strings.HasPrefix(trimmed, "```"):
			info := strings.TrimLeft(trimmed, "`")
			fence = trimmed[:len(trimmed)-len(info)]
			indent = line[:len(line)-len(strings.TrimLeft(line, " \t"))]
			lang = ""
			if f := strings.Fields(info); len(f) > 0 {
				lang = f[0]
			}
			body = nil
			prev := ""
			if i > 0 {
				prev = strings.TrimSpace(lines[i-1])
			}
			m := notRunMarker.FindStringSubmatch(prev)
			switch {
			case shellLangs[lang]:
				cur = &shellBlock{page: page, line: i + 1}
				if m != nil {
					cur.notRun = m[1]
					if cur.notRun == "" {
						t.Errorf("%s:%d: the not-run marker gives no reason", page, i)
					}
				}
			case m != nil:
				t.Errorf("%s:%d: a not-run marker before a %q block, not a shell block", page, i, lang)
			}
		case fence != "" && strings.HasPrefix(trimmed, fence) && strings.Trim(trimmed, "`") == "":
			text := strings.Join(body, "\n") + "\n"
			if cur != nil {
				cur.script = text
				blocks = append(blocks, *cur)
				lastEnd = i + 1
			} else if lang == "text" && len(blocks) > 0 && onlyBlank(lines[lastEnd:i-len(body)-1]) {
				blocks[len(blocks)-1].output, blocks[len(blocks)-1].hasOut = text, true
			}
			fence, cur = "", nil
		case fence != "":
			body = append(body, strings.TrimPrefix(line, indent))
		default:
			if notRunMarker.MatchString(trimmed) && !strings.HasPrefix(strings.TrimSpace(lines[min(i+1, len(lines)-1)]), "```") {
				t.Errorf("%s:%d: a not-run marker that no block follows on the next line", page, i+1)
			}
		}
	}
	return blocks
}

func onlyBlank(lines []string) bool {
	for _, l := range lines {
		if strings.TrimSpace(l) != "" {
			return false
		}
	}
	return true
}

// TestShellBlocks runs every shell block of README.md and docs/ that is
// not marked "not run", as docs/testing.md describes: the blocks of one
// page in order, each from the root of a scratch copy of the repository
// of its own page, with the worker built from this checkout on PATH and a
// test database in place of the local one; pages run in parallel. A block
// followed by a ```text block must print that text on stdout. A block
// that fails, or prints something else, fails the test.
func TestShellBlocks(t *testing.T) {
	blocks := shellBlocks(t)
	byPage := map[string][]shellBlock{}
	var pages []string
	marked := 0
	for _, b := range blocks {
		if b.notRun != "" {
			marked++
			continue
		}
		if byPage[b.page] == nil {
			pages = append(pages, b.page)
		}
		byPage[b.page] = append(byPage[b.page], b)
	}
	if len(pages) == 0 {
		t.Fatalf("none of the %d shell blocks runs: is the marker convention still the one of docs/testing.md?", len(blocks))
	}
	t.Logf("%d shell blocks: %d run, %d marked not run", len(blocks), len(blocks)-marked, marked)
	bin := buildWorker(t)
	for _, page := range pages {
		t.Run(page, func(t *testing.T) {
			t.Parallel()
			runPage(t, bin, byPage[page])
		})
	}
}

// Substituted in a block before it runs: the quick start's database, and
// the ports a page's programs listen on, which the test gives free ones.
const (
	localDatabaseURL = "postgres://postgres@127.0.0.1:5432/worker?sslmode=disable"
	localShopAddr    = "localhost:8080"
)

// runPage runs one page's runnable blocks in order, against a database of
// the page's own where a block names the worker.
func runPage(t *testing.T, bin string, blocks []shellBlock) {
	dir := scratchCopy(t)
	shopAddr := freeTCPAddr(t)
	env := append(withoutAppEnv(os.Environ()),
		"PATH="+filepath.Dir(bin)+string(os.PathListSeparator)+os.Getenv("PATH"),
		// A build in the scratch copy reuses what this checkout's builds
		// cached: without -trimpath, the directory is part of the key.
		"GOFLAGS=-trimpath",
		"APP_DATABASE_MAX_CONNS=2",
		"APP_HTTP_ADDR=127.0.0.1:0",
		"SHOP_ADDR="+shopAddr,
	)
	dbURL := ""
	if conns := pageConns(blocks); conns > 0 {
		pgtest.Need(t, pgtest.PoolConns+conns)
		db := pgtest.New(t)
		var release func()
		dbURL, release = db.ChildURL(t, 2, conns-2)
		defer release()
		env = append(env, "APP_DATABASE_URL="+dbURL)
	}
	for _, b := range blocks {
		script := b.script
		if dbURL != "" {
			script = strings.ReplaceAll(script, localDatabaseURL, dbURL)
		}
		script = strings.ReplaceAll(script, localShopAddr, shopAddr)
		stdout, stderr, err := runScript(t, dir, env, script, 10*time.Minute)
		if err != nil {
			t.Errorf("%s:%d: %v\n--- block\n%s--- stdout\n%s--- stderr\n%s", b.page, b.line, err, b.script, stdout, stderr)
			return // the page's later blocks may need this one's effect
		}
		if b.hasOut && !matchOutput(b.output, stdout) {
			t.Errorf("%s:%d: the block printed\n%s\nwhere the page shows\n%s", b.page, b.line, stdout, b.output)
		}
	}
}

// pageConns is the most connections a page's processes hold at once, on
// pools of 2: none where no block names the worker; an operator command's
// 2; and where a block leaves a program running (a line ending in &),
// that worker's (2, the probe, the outbox listener, River's 5), the
// program's own two pools beside it, and an operator command.
func pageConns(blocks []shellBlock) int {
	conns := 0
	for _, b := range blocks {
		if !strings.Contains(b.script, "worker") {
			continue
		}
		conns = max(conns, 2)
		for _, line := range strings.Split(b.script, "\n") {
			line, _, _ = strings.Cut(line, "#")
			if strings.HasSuffix(strings.TrimSpace(line), "&") {
				conns = 15
			}
		}
	}
	return conns
}

// matchOutput compares printed text with a page's, where "…" in a line of
// the page stands for any text.
func matchOutput(want, got string) bool {
	wl := strings.Split(strings.TrimRight(want, "\n"), "\n")
	gl := strings.Split(strings.TrimRight(got, "\n"), "\n")
	if len(wl) != len(gl) {
		return false
	}
	for i := range wl {
		parts := strings.Split(wl[i], "…")
		for j := range parts {
			parts[j] = regexp.QuoteMeta(parts[j])
		}
		if !regexp.MustCompile("^" + strings.Join(parts, ".*") + "$").MatchString(gl[i]) {
			return false
		}
	}
	return true
}

// runScript runs a block with bash -e -o pipefail in its own process
// group. When bash has exited, what the block left running in the
// background gets SIGTERM, then SIGKILL if it is still there after 20s.
func runScript(t *testing.T, dir string, env []string, script string, limit time.Duration) (stdout, stderr string, err error) {
	t.Helper()
	outFile, errFile := tempFile(t), tempFile(t)
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-e", "-o", "pipefail", "-c", script)
	cmd.Dir, cmd.Env = dir, env
	cmd.Stdin = nil
	// Files, not pipes: Wait then returns when bash exits, not when the
	// last background process closes its copy of the pipe.
	cmd.Stdout, cmd.Stderr = outFile, errFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	err = cmd.Run()
	if cmd.Process != nil {
		stopGroup(t, cmd.Process.Pid)
	}
	if ctx.Err() != nil {
		err = fmt.Errorf("still running after %s: %w", limit, err)
	}
	return readBack(t, outFile), readBack(t, errFile), err
}

// stopGroup ends a process group and waits, bounded, until it is gone.
func stopGroup(t *testing.T, pgid int) {
	t.Helper()
	if err := syscall.Kill(-pgid, syscall.SIGTERM); errors.Is(err, syscall.ESRCH) {
		return
	}
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if err := syscall.Kill(-pgid, 0); errors.Is(err, syscall.ESRCH) {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Errorf("process group %d still there 20s after SIGTERM; killing it", pgid)
	_ = syscall.Kill(-pgid, syscall.SIGKILL)
}

// buildWorker builds cmd/worker from this checkout, with -trimpath as the
// scratch copies' builds.
func buildWorker(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "worker")
	start := time.Now()
	if out, err := exec.Command("go", "build", "-trimpath", "-o", bin, "./cmd/worker").CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/worker: %v\n%s", err, out)
	}
	t.Logf("built the worker in %s", time.Since(start).Round(time.Second))
	return bin
}

// scratchCopy copies the repository's files (tracked, and new ones not
// ignored) into a directory of the test's own, so a block may write where
// it likes.
func scratchCopy(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard").Output()
	if err != nil {
		t.Fatalf("git ls-files (the docs test copies the repository's files): %v", err)
	}
	dir := t.TempDir()
	for _, name := range strings.Split(strings.TrimRight(string(out), "\x00"), "\x00") {
		info, err := os.Lstat(name)
		if errors.Is(err, fs.ErrNotExist) || err == nil && !info.Mode().IsRegular() {
			continue // deleted in the working tree, or a link or submodule
		} else if err != nil {
			t.Fatal(err)
		}
		dst := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := copyFile(name, dst, info.Mode().Perm()); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func copyFile(src, dst string, perm fs.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, perm)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// withoutAppEnv drops the caller's APP_* settings, so the blocks run with
// the test's.
func withoutAppEnv(env []string) []string {
	var out []string
	for _, kv := range env {
		if !strings.HasPrefix(kv, "APP_") {
			out = append(out, kv)
		}
	}
	return out
}

func freeTCPAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func tempFile(t *testing.T) *os.File {
	t.Helper()
	f, err := os.CreateTemp(t.TempDir(), "out")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func readBack(t *testing.T, f *os.File) string {
	t.Helper()
	b, err := os.ReadFile(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	return string(bytes.ToValidUTF8(b, []byte("?")))
}
