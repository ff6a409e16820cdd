package worker

import (
	"bytes"
	"flag"
	"fmt"
	"go/ast"
	"go/doc"
	"go/parser"
	"go/printer"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// publicPackages are the directories of the module's public packages.
var publicPackages = []string{".", "inbox", "outbox", "tasks"}

var updateAPI = flag.Bool("update-api", false, "rewrite api.txt with the current public API")

// TestPublicAPI guards the public API: every exported name of the public
// packages, with its signature, must be in api.txt, and nothing else.
// Growing or changing the surface is a decision: after making it, run
//
//	go test -run TestPublicAPI . -update-api
//
// and commit api.txt with the change.
func TestPublicAPI(t *testing.T) {
	var got []string
	for _, dir := range publicPackages {
		got = append(got, exportedAPI(t, dir)...)
	}
	text := strings.Join(got, "\n") + "\n"
	if *updateAPI {
		if err := os.WriteFile("api.txt", []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile("api.txt")
	if err != nil {
		t.Fatal(err)
	}
	if added, removed := diffLines(strings.Split(string(want), "\n"), got); len(added)+len(removed) > 0 {
		t.Errorf("the public API changed; if that is intended, run `go test -run TestPublicAPI . -update-api` and commit api.txt\nadded:%s\nremoved:%s",
			listed(added), listed(removed))
	}
}

// TestPublicAPIDocumented checks that every exported name has a doc
// comment.
func TestPublicAPIDocumented(t *testing.T) {
	for _, dir := range publicPackages {
		p := docPackage(t, dir)
		check := func(name, text string) {
			if strings.TrimSpace(text) == "" {
				t.Errorf("%s: %s has no doc comment", p.ImportPath, name)
			}
		}
		check("the package", p.Doc)
		for _, f := range p.Funcs {
			check(f.Name, f.Doc)
		}
		for _, ty := range p.Types {
			check(ty.Name, ty.Doc)
			for _, f := range append(ty.Funcs, ty.Methods...) {
				check(ty.Name+"."+f.Name, f.Doc)
			}
		}
		for _, v := range append(p.Vars, p.Consts...) {
			check(strings.Join(v.Names, ", "), v.Doc)
		}
	}
}

func docPackage(t *testing.T, dir string) *doc.Package {
	t.Helper()
	fset := token.NewFileSet()
	pkgs, err := parser.ParseDir(fset, dir, func(fi os.FileInfo) bool { return !strings.HasSuffix(fi.Name(), "_test.go") }, parser.ParseComments)
	if err != nil {
		t.Fatal(err)
	}
	if len(pkgs) != 1 {
		t.Fatalf("%s: want one package, got %d", dir, len(pkgs))
	}
	for _, p := range pkgs {
		return doc.New(p, filepath.ToSlash(dir), 0)
	}
	return nil
}

// exportedAPI lists each exported declaration of the package in dir as one
// line: "pkg: declaration", without comments or bodies.
func exportedAPI(t *testing.T, dir string) []string {
	t.Helper()
	fset := token.NewFileSet()
	p := docPackage(t, dir)
	var lines []string
	add := func(node any) {
		var b bytes.Buffer
		if err := printer.Fprint(&b, fset, node); err != nil {
			t.Fatal(err)
		}
		lines = append(lines, fmt.Sprintf("%s: %s", p.Name, strings.Join(strings.Fields(b.String()), " ")))
	}
	funcs := func(fs []*doc.Func) {
		for _, f := range fs {
			f.Decl.Doc, f.Decl.Body = nil, nil
			add(f.Decl)
		}
	}
	values := func(vs []*doc.Value) {
		for _, v := range vs {
			v.Decl.Doc = nil
			add(stripComments(v.Decl))
		}
	}
	values(p.Consts)
	values(p.Vars)
	funcs(p.Funcs)
	for _, ty := range p.Types {
		ty.Decl.Doc = nil
		add(stripComments(ty.Decl))
		for _, line := range aliasedAPI(t, dir, ty) {
			lines = append(lines, p.Name+": "+line)
		}
		values(ty.Consts)
		values(ty.Vars)
		funcs(ty.Funcs)
		funcs(ty.Methods)
	}
	return lines
}

// aliasedAPI lists what an alias of an internal type makes public: the
// aliased type's declaration and its exported methods, as "Alias:
// declaration" lines, so that a change there is a change of the public API.
func aliasedAPI(t *testing.T, dir string, ty *doc.Type) []string {
	t.Helper()
	spec := ty.Decl.Specs[0].(*ast.TypeSpec)
	sel, ok := spec.Type.(*ast.SelectorExpr)
	if !spec.Assign.IsValid() || !ok {
		return nil
	}
	qual := sel.X.(*ast.Ident).Name
	internalDir := ""
	for _, imp := range importsOf(t, dir) {
		path := strings.Trim(imp.Path.Value, `"`)
		if (imp.Name != nil && imp.Name.Name == qual) || (imp.Name == nil && filepath.Base(path) == qual) {
			rest, ok := strings.CutPrefix(path, modulePath(t)+"/")
			if !ok {
				return nil // an alias of another module's type
			}
			internalDir = rest
		}
	}
	if internalDir == "" {
		t.Fatalf("%s: cannot find the package of %s", dir, qual)
	}
	for _, target := range docPackage(t, internalDir).Types {
		if target.Name == sel.Sel.Name {
			var out []string
			for _, l := range exportedOf(t, target) {
				out = append(out, ty.Name+" = "+l)
			}
			return out
		}
	}
	t.Fatalf("%s: %s.%s not found in %s", dir, qual, sel.Sel.Name, internalDir)
	return nil
}

// exportedOf is the type's declaration and exported methods, one per line.
func exportedOf(t *testing.T, ty *doc.Type) []string {
	t.Helper()
	var lines []string
	print := func(node any) {
		var b bytes.Buffer
		if err := printer.Fprint(&b, token.NewFileSet(), node); err != nil {
			t.Fatal(err)
		}
		lines = append(lines, strings.Join(strings.Fields(b.String()), " "))
	}
	ty.Decl.Doc = nil
	print(stripComments(ty.Decl))
	for _, m := range ty.Methods {
		m.Decl.Doc, m.Decl.Body = nil, nil
		print(m.Decl)
	}
	return lines
}

func importsOf(t *testing.T, dir string) []*ast.ImportSpec {
	t.Helper()
	pkgs, err := parser.ParseDir(token.NewFileSet(), dir, func(fi os.FileInfo) bool { return !strings.HasSuffix(fi.Name(), "_test.go") }, parser.ImportsOnly)
	if err != nil {
		t.Fatal(err)
	}
	var specs []*ast.ImportSpec
	for _, p := range pkgs {
		for _, f := range p.Files {
			specs = append(specs, f.Imports...)
		}
	}
	return specs
}

// modulePath is the module's path, from go.mod.
func modulePath(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("go.mod")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		if path, ok := strings.CutPrefix(strings.TrimSpace(line), "module "); ok {
			return strings.TrimSpace(path)
		}
	}
	t.Fatal("go.mod has no module line")
	return ""
}

// stripComments drops the comments of a declaration's fields and specs, so
// that only rewording a doc comment never counts as an API change.
func stripComments(d *ast.GenDecl) *ast.GenDecl {
	ast.Inspect(d, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.Field:
			n.Doc, n.Comment = nil, nil
		case *ast.TypeSpec:
			n.Doc, n.Comment = nil, nil
		case *ast.ValueSpec:
			n.Doc, n.Comment = nil, nil
		}
		return true
	})
	return d
}

// listed is lines as an indented list, or " none".
func listed(lines []string) string {
	if len(lines) == 0 {
		return " none"
	}
	return "\n\t" + strings.Join(lines, "\n\t")
}

// diffLines returns the lines only in got (added) and only in want
// (removed).
func diffLines(want, got []string) (added, removed []string) {
	in := func(list []string) map[string]bool {
		m := map[string]bool{}
		for _, l := range list {
			if l != "" {
				m[l] = true
			}
		}
		return m
	}
	w, g := in(want), in(got)
	for _, l := range got {
		if !w[l] {
			added = append(added, l)
		}
	}
	for _, l := range want {
		if l != "" && !g[l] {
			removed = append(removed, l)
		}
	}
	return added, removed
}
