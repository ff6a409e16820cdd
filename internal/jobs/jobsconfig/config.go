// Package jobs runs named fixed-delay jobs on gocron, each run guarded by a
// lease from the lock port when several replicas run.
package jobsconfig

import (
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/worker-dev/worker/internal/obs"
)

// Definition is one job under `jobs:` in configs/worker.yaml.
type Definition struct {
	Name         string            `koanf:"name" yaml:"name"`
	Kind         string            `koanf:"kind" yaml:"kind"` // sql | http
	Delay        time.Duration     `koanf:"delay" yaml:"delay"`
	InitialDelay time.Duration     `koanf:"initial_delay" yaml:"initial_delay"`
	Timeout      time.Duration     `koanf:"timeout" yaml:"timeout"`
	LeaseTTL     time.Duration     `koanf:"lease_ttl" yaml:"lease_ttl"`
	Enabled      *bool             `koanf:"enabled" yaml:"enabled"`
	SQL          string            `koanf:"sql" yaml:"sql,omitempty"`
	URL          string            `koanf:"url" yaml:"url,omitempty"`
	Method       string            `koanf:"method" yaml:"method,omitempty"`
	Headers      map[string]string `koanf:"headers" yaml:"headers,omitempty"`
}

// DefaultTimeout bounds a run whose Spec sets no timeout. A run must never
// hang without bound: it would hold its lease (renewed) and a concurrency
// slot forever. Five minutes is long for a periodic job yet short enough
// that a stuck one is noticed; set timeout explicitly for longer work.
const DefaultTimeout = 5 * time.Minute

// Job kinds a Definition can name.
const (
	KindSQL  = "sql"
	KindHTTP = "http"
)

// httpMethods are the methods an http job may use. CONNECT and TRACE make no
// sense for a scheduled call, so a typo cannot silently pick them.
var httpMethods = []string{"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"}

// namePattern keeps job names usable as a lock key, a metric label and a
// table key: short, printable, no spaces.
var namePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$`)

// ValidName reports whether name may name a job, configured or registered
// in Go.
func ValidName(name string) bool { return namePattern.MatchString(name) }

// minLeaseTTL keeps a configured lease from being so short that its
// heartbeat (every ttl/3) hammers the database or cannot keep up.
const minLeaseTTL = time.Second

// DefinitionError is one problem in one job definition. Its message names
// the job, the key and what is allowed, so an operator can fix the file
// without reading code.
type DefinitionError struct {
	Index int    // position under jobs:
	Name  string // the job's name, possibly empty
	Key   string // the offending key, e.g. "delay"
	Msg   string
}

func (e *DefinitionError) Error() string {
	return fmt.Sprintf("jobs[%d] %q: %s %s", e.Index, e.Name, e.Key, e.Msg)
}

// IsEnabled reports whether the job should be scheduled; unset means yes.
func (d Definition) IsEnabled() bool { return d.Enabled == nil || *d.Enabled }

// Validate checks one definition on its own. Errors name the job and key;
// the index in them is 0 because a lone definition has no position; use
// ValidateDefinitions for a whole list.
func (d Definition) Validate() error { return d.validate(0) }

func (d Definition) validate(i int) error {
	var errs []error
	bad := func(key, format string, args ...any) {
		errs = append(errs, &DefinitionError{Index: i, Name: d.Name, Key: key, Msg: fmt.Sprintf(format, args...)})
	}
	if d.Name == "" {
		bad("name", "is missing; want a unique name such as cleanup-sessions")
	} else if !ValidName(d.Name) {
		bad("name", "%q is not allowed; want 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit", d.Name)
	}
	switch {
	case d.Delay == 0:
		bad("delay", "is missing; want a positive duration such as 30s")
	case d.Delay < 0:
		bad("delay", "is %s; want a positive duration such as 30s", d.Delay)
	}
	for _, f := range []struct {
		key string
		v   time.Duration
	}{{"initial_delay", d.InitialDelay}, {"timeout", d.Timeout}, {"lease_ttl", d.LeaseTTL}} {
		if f.v < 0 {
			bad(f.key, "is %s; want 0 (the default) or a positive duration", f.v)
		}
	}
	if d.LeaseTTL > 0 && d.LeaseTTL < minLeaseTTL {
		bad("lease_ttl", "is %s; want at least %s (it is renewed every ttl/3)", d.LeaseTTL, minLeaseTTL)
	}
	switch d.Kind {
	case KindSQL:
		if strings.TrimSpace(d.SQL) == "" {
			bad("sql", "is empty; a sql job needs the statements to run in one transaction")
		}
		for _, f := range []struct {
			key string
			set bool
		}{{"url", d.URL != ""}, {"method", d.Method != ""}, {"headers", len(d.Headers) > 0}} {
			if f.set {
				bad(f.key, "is set but kind is sql; url, method and headers belong to kind http")
			}
		}
	case KindHTTP:
		if d.URL == "" {
			bad("url", "is empty; an http job needs an absolute http:// or https:// URL")
		} else if u, err := url.Parse(d.URL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			bad("url", "%q is not an absolute http:// or https:// URL", obs.RedactURL(d.URL))
		}
		if d.Method != "" && !slices.Contains(httpMethods, strings.ToUpper(d.Method)) {
			bad("method", "%q is not allowed; want one of %s (default GET)", d.Method, strings.Join(httpMethods, ", "))
		}
		for name, value := range d.Headers {
			switch {
			case !isToken(name):
				bad("headers", "%q is not a valid header name", name)
			case strings.ContainsAny(value, "\r\n\x00"):
				bad("headers", "%s: the value contains a line break or NUL", name)
			case strings.ContainsFunc(value, func(r rune) bool { return r < ' ' && r != '\t' || r == 0x7f }):
				// Go's client refuses these when it sends: every run would fail.
				bad("headers", "%s: the value contains a control character", name)
			}
		}
		if d.SQL != "" {
			bad("sql", "is set but kind is http; sql belongs to kind sql")
		}
	case "":
		bad("kind", "is missing; want sql or http")
	default:
		bad("kind", "%q is unknown; want sql or http", d.Kind)
	}
	return errors.Join(errs...)
}

// ValidateDefinitions checks every definition and that names are unique.
// It reports every problem at once, one per line, so a broken file is fixed
// in one pass.
func ValidateDefinitions(defs []Definition) error {
	var errs []error
	first := map[string]int{}
	for i, d := range defs {
		if err := d.validate(i); err != nil {
			errs = append(errs, err)
		}
		if d.Name == "" {
			continue
		}
		if j, dup := first[d.Name]; dup {
			errs = append(errs, &DefinitionError{Index: i, Name: d.Name, Key: "name",
				Msg: fmt.Sprintf("duplicates jobs[%d]; every job needs a unique name (it is the lock key)", j)})
			continue
		}
		first[d.Name] = i
	}
	return errors.Join(errs...)
}

// isToken reports whether s is an HTTP token (RFC 9110 section 5.6.2), the
// syntax of a header name. Go's client rejects other names only when it
// sends, which would fail every run.
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range []byte(s) {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return true
}
