package worker

import (
	"io/fs"
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
	for _, page := range append(docPages(t), "README.md") {
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

// docPages are the pages under docs/, in every folder.
func docPages(t *testing.T) []string {
	t.Helper()
	var pages []string
	err := filepath.WalkDir("docs", func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(p, ".md") {
			pages = append(pages, p)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return pages
}

// maxPageLines bounds a page, as the README's 150 lines do: a reference page
// stays something to look a setting up in, and figures and inner workings
// go to pages of their own (docs/performance/, outbox-internals.md). A
// page not listed gets defaultMaxPageLines.
var maxPageLines = map[string]int{
	"docs/outbox.md":            500,
	"docs/lock.md":              650,
	"docs/outbox-internals.md":  720,
	"docs/performance/relay.md": 920,
}

const defaultMaxPageLines = 500

func TestDocPagesStayShort(t *testing.T) {
	t.Parallel()
	for _, page := range docPages(t) {
		limit, ok := maxPageLines[page]
		if !ok {
			limit = defaultMaxPageLines
		}
		if n := strings.Count(readText(t, page), "\n"); n > limit {
			t.Errorf("%s has %d lines, more than its %d: split it by purpose (reference, operations, docs/performance/)", page, n, limit)
		}
	}
}

// goDocRef is a Go comment's pointer into the docs: docs/outbox.md#storage,
// or docs/outbox.md, "Storage" (also across a comment's line break).
var goDocRef = regexp.MustCompile(`docs/([\w/.-]+\.md)(?:#([\w-]+)|(?:,\s*|\s+)(?://\s*)?\(?"([^"\n]{1,60})")`)

// Every pointer from a Go comment into a page's heading leads to one, so a
// page split by purpose leaves no comment pointing at a moved section.
func TestGoCommentDocLinksResolve(t *testing.T) {
	t.Parallel()
	err := filepath.WalkDir(".", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(p, ".go") || p == "docs_test.go" {
			return err
		}
		for _, m := range goDocRef.FindAllStringSubmatch(readText(t, p), -1) {
			file := filepath.Join("docs", m[1])
			if _, err := os.Stat(file); err != nil {
				t.Errorf("%s: %s: %v", p, m[0], err)
				continue
			}
			anchor := m[2]
			if anchor == "" {
				anchor = slug(m[3])
			}
			if !slugs(t, file)[anchor] {
				t.Errorf("%s: %s: %s has no heading #%s", p, strings.Join(strings.Fields(m[0]), " "), file, anchor)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
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
		out[slug(strings.TrimLeft(line, "#"))] = true
	}
	return out
}

// slug is a heading's anchor, as GitHub makes it.
func slug(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(strings.TrimSpace(heading)) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9':
			b.WriteRune(r)
		}
	}
	return b.String()
}

func readText(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
