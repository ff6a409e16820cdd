package config

import (
	"errors"
	"os"
	"regexp"
	"strconv"
	"strings"

	goyaml "github.com/goccy/go-yaml"
	goyamlparser "github.com/goccy/go-yaml/parser"
	"go.yaml.in/yaml/v3"
)

// Helpers that make configuration errors name what the operator wrote: the
// file and line, the nearest known key, the environment variable a value
// came from, and never a URL's credentials.

// fileError reports a configuration file that cannot be read or parsed.
// For a syntax error it names the line and column of the problem itself:
// the YAML decoder (yaml.v3) names the line where the enclosing block
// starts, counted from 0 for some errors, so a bad line 3 was reported as
// line 2 or 1. goccy/go-yaml's parser points at the offending token.
func fileError(path string, err error) error {
	if b, rerr := os.ReadFile(path); rerr == nil {
		_, perr := goyamlparser.ParseBytes(b, 0)
		var syntax *goyaml.SyntaxError
		if errors.As(perr, &syntax) && syntax.Token != nil {
			pos := syntax.Token.Position
			return Errorf("config file %s:%d:%d: %s", path, pos.Line, pos.Column, syntax.Message)
		}
	}
	return Errorf("config file %s: %v", path, err)
}

// lineFinder locates keys in the YAML file, for "file:line" in messages.
type lineFinder struct {
	path string
	root *yaml.Node // nil when the file does not parse as YAML
}

func fileLines(path string) lineFinder {
	f := lineFinder{path: path}
	if b, err := os.ReadFile(path); err == nil {
		var doc yaml.Node
		if yaml.Unmarshal(b, &doc) == nil && len(doc.Content) == 1 {
			f.root = doc.Content[0]
		}
	}
	return f
}

// at returns "path:line" for the key path (mapping keys, or sequence
// indexes as numbers), or the line of its deepest part found; just "path"
// when nothing is found.
func (f lineFinder) at(keys ...string) string {
	line, n := 0, f.root
	for _, k := range keys {
		if n == nil {
			break
		}
		next := (*yaml.Node)(nil)
		switch n.Kind {
		case yaml.MappingNode:
			for i := 0; i+1 < len(n.Content); i += 2 {
				if n.Content[i].Value == k {
					line, next = n.Content[i].Line, n.Content[i+1]
					break
				}
			}
		case yaml.SequenceNode:
			if i, err := strconv.Atoi(k); err == nil && i >= 0 && i < len(n.Content) {
				next = n.Content[i]
				line = next.Line
			}
		}
		n = next
	}
	if line == 0 {
		return f.path
	}
	return f.path + ":" + strconv.Itoa(line)
}

// didYouMean suggests the known key closest to key: by spelling, or the
// same last part under another section. It returns "" when none is close.
func didYouMean(key string, known []string) string {
	best, bestDist := "", len(key)/3+1 // at most a third of the key misspelt
	for _, k := range known {
		if d := editDistance(key, k); d < bestDist {
			best, bestDist = k, d
		}
	}
	if best == "" {
		// The key of another section: every section that has it.
		leaf := key[strings.LastIndex(key, ".")+1:]
		var sections []string
		for _, k := range known {
			if strings.HasSuffix(k, "."+leaf) {
				sections = append(sections, k)
			}
		}
		best = strings.Join(sections, " or ")
	}
	if best == "" {
		return ""
	}
	return " (did you mean " + best + "?)"
}

// editDistance counts the insertions, deletions, substitutions and swaps of
// neighbours that turn a into b (optimal string alignment), so "dealy" is
// one edit from "delay".
func editDistance(a, b string) int {
	d := make([][]int, len(a)+1)
	for i := range d {
		d[i] = make([]int, len(b)+1)
		d[i][0] = i
	}
	for j := range d[0] {
		d[0][j] = j
	}
	for i := 1; i <= len(a); i++ {
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			d[i][j] = min(d[i-1][j]+1, d[i][j-1]+1, d[i-1][j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				d[i][j] = min(d[i][j], d[i-2][j-2]+1)
			}
		}
	}
	return d[len(a)][len(b)]
}

// nameEnvSources rewrites a configuration error so that each key whose value
// came from the environment is named by its variable, as the operator set
// it: outbox.batch_size=-1 becomes APP_OUTBOX_BATCH_SIZE=-1. Messages built
// outside this package (the outbox's) know only key names.
func nameEnvSources(err error, fromEnv map[string]string) error {
	var ce *Error
	if !errors.As(err, &ce) {
		return err
	}
	msg := ce.Msg
	for key, env := range fromEnv {
		re := regexp.MustCompile(`(^|[^a-z0-9_.])` + regexp.QuoteMeta(key) + `($|[^a-z0-9_.])`)
		msg = re.ReplaceAllString(msg, "${1}"+env+"${2}")
		// Some messages name both, "key (ENV)": say it once.
		msg = strings.ReplaceAll(msg, env+" ("+env+")", env)
	}
	return &Error{Msg: msg, Err: ce.Err}
}
