// Package docs holds the code that the Go snippets of README.md and docs/
// quote, and the test that keeps every snippet true to code that builds.
package docs

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// root is the repository's root, seen from this package's directory.
const root = "../.."

// block is one ```go block: its page, its opening fence's line, its lines.
type block struct {
	page  string
	line  int
	lines []string
}

// TestGoSnippets holds every ```go block of README.md and docs/ to the
// convention of docs/testing.md: a block that starts with a package clause
// is a whole file and must pass go vet; any other block is an excerpt whose
// first line, "// From <path>", names a file of the repository that holds
// the block's other non-blank lines in the same order.
func TestGoSnippets(t *testing.T) {
	pages := []string{filepath.Join(root, "README.md")}
	err := filepath.WalkDir(filepath.Join(root, "docs"), func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(p, ".md") {
			pages = append(pages, p)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	var blocks []block
	for _, p := range pages {
		blocks = append(blocks, goBlocks(t, p)...)
	}
	if len(blocks) == 0 {
		t.Fatal("no ```go block found: is root still the repository's root?")
	}
	for _, b := range blocks {
		var err error
		if strings.HasPrefix(strings.TrimSpace(firstNonBlank(b.lines)), "package ") {
			err = vetFile(t, b)
		} else {
			err = checkExcerpt(b.lines)
		}
		if err != nil {
			t.Errorf("%s:%d: %v", b.page, b.line, err)
		}
	}
}

// goBlocks returns the ```go blocks of a page, without their fence's indent
// (a block in a list item is indented). Other fenced blocks are skipped
// whole, so that a fence shown inside one is not taken for a block.
func goBlocks(t *testing.T, path string) []block {
	src, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	page, _ := filepath.Rel(root, path)
	var blocks []block
	var cur *block
	fence, indent := "", ""
	for i, line := range strings.Split(string(src), "\n") {
		trimmed := strings.TrimSpace(line)
		switch {
		case fence == "" && strings.HasPrefix(trimmed, "```"):
			info := strings.TrimLeft(trimmed, "`")
			fence = trimmed[:len(trimmed)-len(info)]
			indent = line[:len(line)-len(strings.TrimLeft(line, " \t"))]
			if f := strings.Fields(info); len(f) > 0 && f[0] == "go" {
				cur = &block{page: page, line: i + 1}
			}
		case fence != "" && strings.HasPrefix(trimmed, fence) && strings.Trim(trimmed, "`") == "":
			if cur != nil {
				blocks = append(blocks, *cur)
			}
			fence, cur = "", nil
		case cur != nil:
			cur.lines = append(cur.lines, strings.TrimPrefix(line, indent))
		}
	}
	return blocks
}

// vetFile runs go vet on a whole-file block, built as a package of its own
// in this module, in a directory that "./..." skips: its name starts with _.
func vetFile(t *testing.T, b block) error {
	dir, err := os.MkdirTemp(".", "_snippet")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	page, err := filepath.Abs(filepath.Join(root, b.page))
	if err != nil {
		t.Fatal(err)
	}
	// The //line comment makes go vet name the page's lines, not the copy's.
	src := fmt.Sprintf("//line %s:%d\n%s\n", page, b.line+1, strings.Join(b.lines, "\n"))
	if err := os.WriteFile(filepath.Join(dir, "snippet.go"), []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("go", "vet", ".")
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go vet: %v\n%s", err, out)
	}
	return nil
}

// checkExcerpt checks that the file named by an excerpt's first line holds
// its other non-blank lines in order, each compared without the white
// space around it, so that the page may indent with spaces or tabs.
func checkExcerpt(lines []string) error {
	var from []string
	if len(lines) > 0 {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(lines[0]), "// From "); ok {
			from = strings.Fields(rest)
		}
	}
	if len(from) == 0 {
		return fmt.Errorf(`the block starts neither with a package clause (a whole file) nor with "// From <path>" (an excerpt): %q`, firstNonBlank(lines))
	}
	path := from[0]
	src, err := os.ReadFile(filepath.Join(root, path))
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%s, which the block quotes, does not exist", path)
	} else if err != nil {
		return err
	}
	file := strings.Split(string(src), "\n")
	i := 0
	for _, l := range lines[1:] {
		l = strings.TrimSpace(l)
		if l == "" {
			continue
		}
		for i < len(file) && strings.TrimSpace(file[i]) != l {
			i++
		}
		if i == len(file) {
			return fmt.Errorf("%q is not in %s, or not after the lines before it", l, path)
		}
		i++
	}
	return nil
}

func firstNonBlank(lines []string) string {
	for _, l := range lines {
		if strings.TrimSpace(l) != "" {
			return l
		}
	}
	return ""
}
