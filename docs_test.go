package worker

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// The README is a front page whose quick start is the two commands that
// set up what they need, and the second is what CI runs.
func TestReadmeQuickStart(t *testing.T) {
	readme := readText(t, "README.md")
	if n := strings.Count(readme, "\n"); n > 150 {
		t.Errorf("README.md has %d lines; keep it a front page of at most 150 and move the rest under docs/", n)
	}
	_, quick, _ := strings.Cut(readme, "## Quick start\n")
	_, block, _ := strings.Cut(quick, "```sh\n")
	block, _, _ = strings.Cut(block, "```")
	var cmds []string
	for _, line := range strings.Split(strings.TrimSpace(block), "\n") {
		cmd, _, _ := strings.Cut(line, "#")
		cmds = append(cmds, strings.TrimSpace(cmd))
	}
	if strings.Join(cmds, ";") != "scripts/worker;scripts/test" {
		t.Errorf("the quick start's commands are %q, want scripts/worker and scripts/test", cmds)
	}
	if ci := readText(t, ".ci/run"); !strings.Contains(ci, "exec bash scripts/test\n") {
		t.Errorf(".ci/run does not run the README's test command, scripts/test:\n%s", ci)
	}
}

var mdLink = regexp.MustCompile(`\]\(([^)\s]+)\)`)

// Every link from the README and docs/ to a file of the repository, or to
// a heading of a page, leads somewhere.
func TestDocLinksResolve(t *testing.T) {
	pages, err := filepath.Glob("docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	runbooks, _ := filepath.Glob("docs/runbooks/*.md")
	pages = append(append(pages, runbooks...), "README.md")
	for _, page := range pages {
		for _, m := range mdLink.FindAllStringSubmatch(readText(t, page), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			path, anchor, _ := strings.Cut(target, "#")
			file := page
			if path != "" {
				file = filepath.Join(filepath.Dir(page), path)
			}
			if _, err := os.Stat(file); err != nil {
				t.Errorf("%s: link %s: %v", page, target, err)
				continue
			}
			if anchor != "" && !slugs(t, file)[anchor] {
				t.Errorf("%s: link %s: %s has no heading #%s", page, target, file, anchor)
			}
		}
	}
}

// slugs are the anchors of a page's headings, as GitHub makes them.
func slugs(t *testing.T, file string) map[string]bool {
	out := map[string]bool{}
	inCode := false
	for _, line := range strings.Split(readText(t, file), "\n") {
		if strings.HasPrefix(line, "```") {
			inCode = !inCode
		}
		if inCode || !strings.HasPrefix(line, "#") {
			continue
		}
		h := strings.ToLower(strings.TrimSpace(strings.TrimLeft(line, "#")))
		var b strings.Builder
		for _, r := range h {
			switch {
			case r == ' ':
				b.WriteRune('-')
			case r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9':
				b.WriteRune(r)
			}
		}
		out[b.String()] = true
	}
	return out
}

func readText(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
