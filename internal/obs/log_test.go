package obs

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// Secrets must not reach a log line where they sit in a known place,
// however a caller hands them over: in a URL, a key=value DSN, or an
// attribute whose key names a secret.
func TestLoggerNeverPrintsSecrets(t *testing.T) {
	const (
		dsn     = "postgres://app:Pa55-w0rd%21@db.internal:5432/app?sslmode=require"
		webhook = "whsec_dGhpcy1pcy1hLXNpZ25pbmcta2V5"
	)
	var buf bytes.Buffer
	log, err := NewLogger(&buf, "json", "debug", "replica-1")
	if err != nil {
		t.Fatal(err)
	}
	log.Info("connecting to "+dsn, "dsn", dsn)
	log.Error("failed", "error", fmt.Errorf("dial %s: %w", dsn, errors.New("refused")))
	log.Warn("kv dsn", "conn", "host=db user=app password=Pa55-w0rd! dbname=app")
	log.Info("signing", "secret", webhook, slog.Group("sink", "sasl_password", "Pa55-w0rd!", "Authorization", "Bearer "+webhook))
	log.Debug("stringer", "v", stringer("url postgres://x:other-pass@h/db"), "token", secretValue("Pa55-w0rd!"))

	out := buf.String()
	for _, leak := range []string{"Pa55-w0rd", "Pa55-w0rd%21", "dGhpcy1pcy1hLXNpZ25pbmcta2V5", "other-pass"} {
		if strings.Contains(out, leak) {
			t.Errorf("log output leaks %q:\n%s", leak, out)
		}
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 5 {
		t.Fatalf("want 5 lines, got %d:\n%s", len(lines), out)
	}
	for _, l := range lines {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("not JSON: %s", l)
		}
		if m["instance_id"] != "replica-1" {
			t.Errorf("line without instance_id: %s", l)
		}
	}
	if !strings.Contains(out, "postgres://xxxxx@db.internal:5432/app?xxxxx") {
		t.Errorf("masked DSN should keep the host and database for debugging:\n%s", out)
	}
	for _, leak := range []string{"app:", "sslmode=require"} {
		if strings.Contains(out, leak) {
			t.Errorf("log output keeps a URL's user or query string %q:\n%s", leak, out)
		}
	}
}

// secretValue is a secret handed over as a Stringer.
type secretValue string

func (s secretValue) String() string { return string(s) }

// Masking goes by where a secret sits, never by what it spells: words
// that equal a short password stay as they are, in the message and in
// every attribute, while the same values in a secret's place are masked.
// The four passwords are ones that garbled the worker's own lines when
// their text was replaced wherever it appeared.
func TestMaskingLeavesFreeTextAlone(t *testing.T) {
	var buf bytes.Buffer
	log, err := NewLogger(&buf, "json", "info", "i")
	if err != nil {
		t.Fatal(err)
	}
	for _, pw := range []string{"x", "in", "worker", "postgres"} {
		log.Error("exiting", "error", "invalid configuration: x", "password", pw)
		log.Info("worker starting", "lock_provider", "postgres", "sink", "log",
			"dsn", "postgres://postgres:"+pw+"@127.0.0.1:5432/worker?sslmode=disable")
		log.Info("lease", "token", int64(42), "fencing_token", int64(7), "api_key", "")
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 12 {
		t.Fatalf("want 12 lines:\n%s", buf.String())
	}
	for i, l := range lines {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("not JSON: %s", l)
		}
		var want map[string]any
		switch i % 3 {
		case 0:
			want = map[string]any{"msg": "exiting", "error": "invalid configuration: x", "password": "xxxxx"}
		case 1:
			want = map[string]any{"msg": "worker starting", "lock_provider": "postgres", "sink": "log",
				"dsn": "postgres://xxxxx@127.0.0.1:5432/worker?xxxxx"}
		case 2:
			// A number is no secret: a lease's fencing token is logged
			// as token. An empty value says only that none is set.
			want = map[string]any{"msg": "lease", "token": float64(42), "fencing_token": float64(7), "api_key": ""}
		}
		for k, v := range want {
			if m[k] != v {
				t.Errorf("%q is %#v, want %#v: %s", k, m[k], v, l)
			}
		}
	}
}

func TestIsSecretKey(t *testing.T) {
	for _, k := range []string{"password", "Password", "outbox.nats.password", "sasl_password", "secret",
		"webhook_secret", "token", "access_token", "api_key", "X-Api-Key", "authorization", "private_key"} {
		if !IsSecretKey(k) {
			t.Errorf("%q is a secret's key", k)
		}
	}
	for _, k := range []string{"msg", "error", "user", "username", "lock_provider", "key", "url", "tokens_total", "secretary", "password_set"} {
		if IsSecretKey(k) {
			t.Errorf("%q is no secret's key", k)
		}
	}
}

type stringer string

func (s stringer) String() string { return string(s) }

func TestLoggerLevelAndFormat(t *testing.T) {
	var buf bytes.Buffer
	log, err := NewLogger(&buf, "json", "warn", "i")
	if err != nil {
		t.Fatal(err)
	}
	log.Info("hidden")
	log.Warn("shown")
	if strings.Contains(buf.String(), "hidden") || !strings.Contains(buf.String(), "shown") {
		t.Fatalf("level not applied: %s", buf.String())
	}
	if _, err := NewLogger(&buf, "xml", "info", "i"); err == nil {
		t.Error("format xml accepted")
	}
	if _, err := NewLogger(&buf, "json", "loud", "i"); err == nil {
		t.Error("level loud accepted")
	}
}

// A URL in any text loses its user information and query string: a user
// name alone may be a token, and a query often carries one.
func TestMaskDSN(t *testing.T) {
	cases := map[string]string{
		"postgres://u:p@h:5432/d":                                    "postgres://xxxxx@h:5432/d",
		"postgres://u@h/d":                                           "postgres://xxxxx@h/d",
		"postgres://u:p@ss@h/d":                                      "postgres://xxxxx@h/d",
		"postgres://h/d?sslmode=disable&application_name=app":        "postgres://h/d?xxxxx",
		"host=h password='a b' user=u":                               "host=h password=xxxxx user=xxxxx",
		"failed to connect to `user=app database=app`: refused":      "failed to connect to `user=xxxxx database=app`: refused",
		"amqp://guest:guest@127.0.0.1:5672/":                         "amqp://xxxxx@127.0.0.1:5672/",
		"https://TOKEN@hooks.example.com/x?sig=abc#frag":             "https://xxxxx@hooks.example.com/x?xxxxx#frag",
		`dial "postgres://app:pw@db/app?sslmode=require": refused`:   `dial "postgres://xxxxx@db/app?xxxxx": refused`,
		"two: http://a:b@h1/x?q=1 and nats://h2:4222, done":          "two: http://xxxxx@h1/x?xxxxx and nats://h2:4222, done",
		"no url: user@example.com is an address, path/with?question": "no url: user@example.com is an address, path/with?question",
	}
	for in, want := range cases {
		if got := MaskDSN(in); got != want {
			t.Errorf("MaskDSN(%q) = %q, want %q", in, got, want)
		}
		if again := MaskDSN(want); again != want {
			t.Errorf("MaskDSN is not idempotent on %q: %q", want, again)
		}
	}
}

// Every duration reads as Go's duration string, however it was handed
// over: the JSON handler alone writes integer nanoseconds.
func TestLoggerWritesDurationsAsText(t *testing.T) {
	var buf bytes.Buffer
	log, err := NewLogger(&buf, "json", "info", "i")
	if err != nil {
		t.Fatal(err)
	}
	log.Warn("attr", slog.Duration("probe_backoff_max", 5*time.Second))
	log.Warn("pair", "retry_in", 1500*time.Millisecond)
	log.Warn("any", slog.Any("open_for", 168*time.Hour))
	log.With("delay", time.Minute).Warn("with", slog.Group("g", "down_for", 250*time.Microsecond))
	log.LogAttrs(t.Context(), slog.LevelWarn, "attrs", slog.Duration("zero", 0))

	want := map[string]map[string]any{
		"attr":  {"probe_backoff_max": "5s"},
		"pair":  {"retry_in": "1.5s"},
		"any":   {"open_for": "168h0m0s"},
		"with":  {"delay": "1m0s", "g": map[string]any{"down_for": "250µs"}},
		"attrs": {"zero": "0s"},
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != len(want) {
		t.Fatalf("want %d lines, got:\n%s", len(want), buf.String())
	}
	for _, l := range lines {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("not JSON: %s", l)
		}
		for k, v := range want[m["msg"].(string)] {
			if fmt.Sprint(m[k]) != fmt.Sprint(v) {
				t.Errorf("%s: %q is %#v, want %#v", l, k, m[k], v)
			}
		}
	}

	buf.Reset()
	text, err := NewLogger(&buf, "text", "info", "i")
	if err != nil {
		t.Fatal(err)
	}
	text.Warn("text", "retry_in", 5*time.Second)
	if !strings.Contains(buf.String(), "retry_in=5s") {
		t.Errorf("text line: %s", buf.String())
	}
}
