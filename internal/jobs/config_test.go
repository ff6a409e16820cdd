package jobs

import (
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/jobs/jobsconfig"
)

func TestValidateDefinitionsNamesJobAndKey(t *testing.T) {
	ok := jobsconfig.Definition{Name: "ok", Kind: jobsconfig.KindSQL, Delay: time.Second, SQL: "SELECT 1"}
	with := func(f func(d *jobsconfig.Definition)) jobsconfig.Definition {
		d := ok
		f(&d)
		return d
	}
	cases := []struct {
		name string
		defs []jobsconfig.Definition
		want []string // every one must appear in the error
	}{
		{"missing delay", []jobsconfig.Definition{ok, ok, with(func(d *jobsconfig.Definition) { d.Name = "cleanup"; d.Delay = 0 })},
			[]string{`jobs[2] "cleanup": delay is missing; want a positive duration such as 30s`}},
		{"negative delay", []jobsconfig.Definition{with(func(d *jobsconfig.Definition) { d.Delay = -time.Second })},
			[]string{`jobs[0] "ok": delay is -1s; want a positive duration`}},
		{"duplicate name", []jobsconfig.Definition{ok, with(func(d *jobsconfig.Definition) { d.SQL = "SELECT 2" })},
			[]string{`jobs[1] "ok": name duplicates jobs[0]`}},
		{"missing name", []jobsconfig.Definition{with(func(d *jobsconfig.Definition) { d.Name = "" })},
			[]string{`jobs[0] "": name is missing`}},
		{"bad name", []jobsconfig.Definition{with(func(d *jobsconfig.Definition) { d.Name = "has space" })},
			[]string{`jobs[0] "has space": name "has space" is not allowed`}},
		{"unknown kind", []jobsconfig.Definition{with(func(d *jobsconfig.Definition) { d.Kind = "shell" })},
			[]string{`jobs[0] "ok": kind "shell" is unknown; want sql or http`}},
		{"missing kind", []jobsconfig.Definition{with(func(d *jobsconfig.Definition) { d.Kind = "" })},
			[]string{`jobs[0] "ok": kind is missing; want sql or http`}},
		{"empty sql", []jobsconfig.Definition{with(func(d *jobsconfig.Definition) { d.SQL = "  " })},
			[]string{`jobs[0] "ok": sql is empty`}},
		{"url on sql job", []jobsconfig.Definition{with(func(d *jobsconfig.Definition) { d.URL = "http://x" })},
			[]string{`jobs[0] "ok": url is set but kind is sql`}},
		{"empty url", []jobsconfig.Definition{{Name: "ping", Kind: jobsconfig.KindHTTP, Delay: time.Second}},
			[]string{`jobs[0] "ping": url is empty`}},
		{"relative url", []jobsconfig.Definition{{Name: "ping", Kind: jobsconfig.KindHTTP, Delay: time.Second, URL: "/health"}},
			[]string{`jobs[0] "ping": url "/health" is not an absolute http:// or https:// URL`}},
		{"bad method", []jobsconfig.Definition{{Name: "ping", Kind: jobsconfig.KindHTTP, Delay: time.Second, URL: "http://x", Method: "FETCH"}},
			[]string{`jobs[0] "ping": method "FETCH" is not allowed; want one of GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS`}},
		{"negatives", []jobsconfig.Definition{with(func(d *jobsconfig.Definition) {
			d.Timeout, d.InitialDelay, d.LeaseTTL = -time.Second, -time.Second, -time.Second
		})}, []string{
			`jobs[0] "ok": timeout is -1s; want 0 (the default) or a positive duration`,
			`jobs[0] "ok": initial_delay is -1s`,
			`jobs[0] "ok": lease_ttl is -1s`,
		}},
		{"bad header name", []jobsconfig.Definition{{Name: "ping", Kind: jobsconfig.KindHTTP, Delay: time.Second, URL: "http://x",
			Headers: map[string]string{"X Api Key": "s"}}},
			[]string{`jobs[0] "ping": headers "X Api Key" is not a valid header name`}},
		{"header value with a line break", []jobsconfig.Definition{{Name: "ping", Kind: jobsconfig.KindHTTP, Delay: time.Second, URL: "http://x",
			Headers: map[string]string{"X-Api-Key": "a\r\nInjected: yes"}}},
			[]string{`jobs[0] "ping": headers X-Api-Key: the value contains a line break`}},
		{"header value with a control character", []jobsconfig.Definition{{Name: "ping", Kind: jobsconfig.KindHTTP, Delay: time.Second, URL: "http://x",
			Headers: map[string]string{"X-Api-Key": "a\x01b"}}},
			[]string{`jobs[0] "ping": headers X-Api-Key: the value contains a control character`}},
		{"tiny lease", []jobsconfig.Definition{with(func(d *jobsconfig.Definition) { d.LeaseTTL = time.Millisecond })},
			[]string{`jobs[0] "ok": lease_ttl is 1ms; want at least 1s`}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := jobsconfig.ValidateDefinitions(c.defs)
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q\ndoes not contain %q", err, w)
				}
			}
			var de *jobsconfig.DefinitionError
			if !errors.As(err, &de) {
				t.Errorf("error %T is not a *jobsconfig.DefinitionError", err)
			}
		})
	}
}

func TestValidDefinitionsPass(t *testing.T) {
	off := false
	defs := []jobsconfig.Definition{
		{Name: "cleanup", Kind: jobsconfig.KindSQL, Delay: 30 * time.Second, SQL: "DELETE FROM t", Timeout: time.Minute, LeaseTTL: 10 * time.Second},
		{Name: "ping", Kind: jobsconfig.KindHTTP, Delay: time.Minute, URL: "https://example.com/x?token=1", Method: "post", Headers: map[string]string{"X-A": "b"}},
		{Name: "off", Kind: jobsconfig.KindSQL, Delay: time.Second, SQL: "SELECT 1", Enabled: &off},
	}
	if err := jobsconfig.ValidateDefinitions(defs); err != nil {
		t.Fatal(err)
	}
	if err := defs[0].Validate(); err != nil {
		t.Fatal(err)
	}
	specs, err := FromDefinitions(defs, nil, nil)
	if err == nil {
		t.Fatal("a sql job without a pool was accepted")
	}
	specs, err = FromDefinitions(defs[1:], nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(specs) != 1 {
		t.Fatalf("got %d specs, want 1 (the disabled job is left out)", len(specs))
	}
	h := specs[0].Job.(*HTTPJob)
	if h.Method != http.MethodPost || specs[0].Delay != time.Minute {
		t.Fatalf("spec = %+v, job = %+v", specs[0], h)
	}
}

func TestValidationErrorHidesURLSecrets(t *testing.T) {
	err := jobsconfig.Definition{Name: "x", Kind: jobsconfig.KindHTTP, Delay: time.Second, URL: "ftp://user:pw@host/p?token=secret"}.Validate()
	if err == nil || strings.Contains(err.Error(), "secret") || strings.Contains(err.Error(), "pw") {
		t.Fatalf("error = %v", err)
	}
}
