package config

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/knadh/koanf/parsers/yaml"
	"github.com/knadh/koanf/providers/file"
	"github.com/knadh/koanf/v2"
	yamlv3 "go.yaml.in/yaml/v3"

	"github.com/worker-dev/worker/internal/jobs/jobsconfig"
	"github.com/worker-dev/worker/internal/lock"
)

func writeFile(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "worker.yaml")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestDefaults(t *testing.T) {
	cfg, err := Load(writeFile(t, "{}\n"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Database.URL != "postgres://postgres@127.0.0.1:5432/worker?sslmode=disable" ||
		cfg.MultiInstance.Enabled || cfg.Lock.Provider != ProviderInProcess ||
		cfg.Lock.WaitTime != 100*time.Millisecond || cfg.Lock.LeaseTTL != 30*time.Second ||
		cfg.HTTP.Addr != ":9090" || cfg.Shutdown.Timeout != 20*time.Second ||
		cfg.Log.Level != "info" || cfg.Log.Format != "json" || cfg.AsyncExecutor.MaxSize != 10 ||
		!cfg.Database.MigrateOnStart || cfg.Database.ConnectTimeout != 30*time.Second {
		t.Fatalf("unexpected defaults: %+v", cfg)
	}
	host, _ := os.Hostname()
	if !strings.HasPrefix(cfg.Instance.ID, host+"-") || len(cfg.Instance.ID) <= len(host)+1 {
		t.Fatalf("instance id %q: want hostname plus a random suffix", cfg.Instance.ID)
	}
}

func TestLayers(t *testing.T) {
	path := writeFile(t, "lock:\n  wait_time: 5s\n  lease_ttl: 40s\nlog:\n  level: debug\n")
	cfg, err := Load(path, []string{"APP_LOCK_WAIT_TIME=7s", "APP_ASYNC_EXECUTOR_MAX_SIZE=3", "APP_UNRELATED=1"})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Lock.WaitTime != 7*time.Second { // env beats file
		t.Errorf("wait_time = %s, want 7s from the environment", cfg.Lock.WaitTime)
	}
	if cfg.Lock.LeaseTTL != 40*time.Second || cfg.Log.Level != "debug" { // file beats default
		t.Errorf("file values lost: %+v", cfg)
	}
	if cfg.AsyncExecutor.MaxSize != 3 {
		t.Errorf("max_size = %d, want 3", cfg.AsyncExecutor.MaxSize)
	}
}

func TestMissingConfigFile(t *testing.T) {
	_, err := Load(filepath.Join(t.TempDir(), "nope.yaml"), nil)
	if !isConfigError(err) || !strings.Contains(err.Error(), "nope.yaml") {
		t.Fatalf("got %v", err)
	}
}

func TestPrintConfigMasksSecrets(t *testing.T) {
	cfg, err := Load(writeFile(t, "{}"), []string{
		"APP_DATABASE_URL=postgres://app-user:s3cr3t-pw@db:5432/app?application_name=billing",
		"APP_OUTBOX_SINK=webhook", "APP_OUTBOX_WEBHOOK_SECRET=whsec_c2VjcmV0LXNpZ25pbmcta2V5",
		"APP_OUTBOX_WEBHOOK_URL=https://example.test/hook",
		"APP_LOCK_PROVIDER=redis", "APP_LOCK_REDIS_URL=rediss://lease-user:r3d1s-pw@cache:6380/2",
	})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := Print(&out, cfg); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	if !strings.Contains(s, "rediss://xxxxx@cache:6380/2") {
		t.Errorf("config print does not show the Redis URL masked:\n%s", s)
	}
	for _, secret := range []string{"s3cr3t-pw", "c2VjcmV0LXNpZ25pbmcta2V5", "app-user", "billing", "r3d1s-pw", "lease-user"} {
		if strings.Contains(s, secret) {
			t.Fatalf("config print leaks %q:\n%s", secret, s)
		}
	}
	for _, want := range []string{"url: postgres://xxxxx@db:5432/app?xxxxx", "secret: xxxxx", "wait_time: 100ms", "https://example.test/hook"} {
		if !strings.Contains(s, want) {
			t.Errorf("config print lacks %q:\n%s", want, s)
		}
	}
}

// Every setting is documented: a commented default in configs/worker.yaml
// (which must itself load cleanly) and a row in docs/configuration.md.
func TestEverySettingIsDocumented(t *testing.T) {
	const yamlPath, readme = "../../configs/worker.yaml", "../../docs/configuration.md"
	if _, err := Load(yamlPath, nil); err != nil {
		t.Fatalf("shipped config does not load: %v", err)
	}
	k := koanf.New(".")
	if err := k.Load(file.Provider(yamlPath), yaml.Parser()); err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(readme)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range settings() {
		if !k.Exists(s.Key) {
			t.Errorf("%s is missing from configs/worker.yaml", s.Key)
		}
		if !bytes.Contains(doc, []byte("`"+s.Env()+"`")) {
			t.Errorf("%s has no row in docs/configuration.md", s.Env())
		}
	}
}

// `worker config print` promises "secrets masked", and docs/jobs.md says
// logs and messages show an http job's URL without its query string or
// user info. Credentials in a job URL, its headers, or the webhook URL must
// not be printed either.
func TestPrintConfigMasksJobAndWebhookCredentials(t *testing.T) {
	cfg, err := Load(writeFile(t, `
jobs:
  - name: ping
    kind: http
    delay: 30s
    url: https://bot:url-pass@billing.internal/healthz?token=query-token
  - name: hook
    kind: http
    delay: 30s
    url: https://user-token@billing.internal/hook
    headers:
      Authorization: Bearer header-token
`), []string{"APP_OUTBOX_SINK=webhook", "APP_OUTBOX_WEBHOOK_URL=https://hook:hook-pass@example.test/hook?sig=hook-query"})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := Print(&out, cfg); err != nil {
		t.Fatal(err)
	}
	for _, secret := range []string{"url-pass", "user-token", "query-token", "header-token", "hook-pass", "hook-query"} {
		if strings.Contains(out.String(), secret) {
			t.Errorf("config print leaks %q", secret)
		}
	}
	if t.Failed() {
		t.Logf("output:\n%s", out.String())
	}
}

// A YAML duration written without a unit is a number of nanoseconds to the
// decoder. The environment path rejects "30" ("not a duration"); the file
// path must too, instead of scheduling a job every 30ns.
func TestYAMLDurationWithoutUnitIsRejected(t *testing.T) {
	for name, body := range map[string]string{
		"job delay":       "jobs:\n  - {name: j, kind: sql, sql: SELECT 1, delay: 30}\n",
		"connect_timeout": "database:\n  connect_timeout: 30\n",
	} {
		t.Run(name, func(t *testing.T) {
			cfg, err := Load(writeFile(t, body), nil)
			if err == nil {
				d := cfg.Database.ConnectTimeout
				if len(cfg.Jobs) > 0 {
					d = cfg.Jobs[0].Delay
				}
				t.Fatalf("accepted; the value became %s", d)
			}
			if !isConfigError(err) {
				t.Fatalf("%v, want a configuration error", err)
			}
		})
	}
}

// A bad field of a list entry (jobs, tasks.kinds, inbox.sources, and an
// inbox source's variable) is reported as a bad top-level key is: where it
// is (file and line, or the variable), the value, and the form allowed;
// never the decoder's own "'jobs[0].delay' time: invalid duration".
func TestListEntryErrorsNameKeyLineValueAndForm(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, yaml string
		env        []string
		want       []string
	}{
		{"jobs", `jobs:
  - name: a
    kind: sql
    sql: SELECT 1
    delay: "five"
  - {name: b, kind: http, url: "https://h/x", delay: 1s, enabled: perhaps, headers: [1], timeout: 30}
`, nil, []string{
			`:5: jobs[0] "a": delay="five" ` + wantDuration,
			`:6: jobs[1] "b": enabled="perhaps" ` + wantBoolean,
			`:6: jobs[1] "b": headers=[...] ` + wantPairs,
			`:6: jobs[1] "b": timeout=30 ` + wantDuration,
		}},
		{"tasks.kinds", `tasks:
  kinds:
    - name: k
      type: sql
      sql: SELECT 1
      timeout: soon
      max_attempts: many
    - {name: h, type: http, url: "https://h/x", timeuot: 1s}
`, nil, []string{
			`:6: tasks.kinds[0] "k": timeout="soon" ` + wantDuration,
			`:7: tasks.kinds[0] "k": max_attempts="many" ` + wantWholeNumber,
			`:8: tasks.kinds[1] "h": unknown key "timeuot" (did you mean timeout?); allowed: name, type, queue`,
		}},
		{"inbox.sources", `inbox:
  sources:
    - name: orders
      kind: nats
      nats:
        url: "nats://127.0.0.1:4222"
        ack_wait: long
        create_consumer: maybe
        password: {a: b}
      key: [x]
`, nil, []string{
			`:7: inbox.sources[0] "orders": nats.ack_wait="long" ` + wantDuration,
			`:8: inbox.sources[0] "orders": nats.create_consumer="maybe" ` + wantBoolean,
			`:9: inbox.sources[0] "orders": nats.password={...} ` + wantText,
			`:10: inbox.sources[0] "orders": key=[...] ` + wantText,
		}},
		{"an inbox source's variable", `inbox:
  sources:
    - {name: orders, kind: nats, nats: {url: "nats://127.0.0.1:4222"}}
`, []string{"APP_INBOX_SOURCES_ORDERS_NATS_MAX_ACK_PENDING=lots"}, []string{
			`APP_INBOX_SOURCES_ORDERS_NATS_MAX_ACK_PENDING="lots" ` + wantWholeNumber,
		}},
	}
	for _, c := range cases {
		_, err := Load(writeFile(t, c.yaml), c.env)
		if !isConfigError(err) {
			t.Errorf("%s: %v , want exit 78", c.name, err)
			t.Errorf("%s: %v, want a configuration error", c.name, err)
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: want %q in:\n%v", c.name, w, err)
			}
		}
		if strings.Contains(err.Error(), "decoding failed") || strings.Contains(err.Error(), "'") && strings.Contains(err.Error(), "cannot parse") {
			t.Errorf("%s: the decoder's own error reached the operator:\n%v", c.name, err)
		}
	}
}

// A job's own lease_ttl must be at least 1s ("it is renewed every ttl/3");
// the global default every other job inherits had no such floor.
func TestTinyLeaseTTLIsRejected(t *testing.T) {
	_, err := Load(writeFile(t, "{}\n"), []string{"APP_LOCK_LEASE_TTL=10ms", "APP_LOCK_WAIT_TIME=5ms"})
	if !isConfigError(err) || !strings.Contains(err.Error(), "APP_LOCK_LEASE_TTL") {
		t.Fatalf("APP_LOCK_LEASE_TTL=10ms: got %v, want exit 78 naming the key", err)
	}
}

// A configuration error keeps its cause: an invalid job definition still
// reaches callers as a *jobsconfig.DefinitionError.
func TestConfigErrorKeepsItsCause(t *testing.T) {
	t.Parallel()
	_, err := Load(writeFile(t, "jobs:\n  - {name: a, kind: sql, sql: SELECT 1}\n"), nil)
	var de *jobsconfig.DefinitionError
	if !isConfigError(err) || !errors.As(err, &de) || de.Key != "delay" {
		t.Fatalf("got %v , want exit 78 wrapping the definition error for delay", err)
	}
}

// A value from the environment is named by its variable, also in messages
// built by other packages, which know only key names.
func TestConfigErrorsNameTheEnvironmentVariable(t *testing.T) {
	t.Parallel()
	cases := []struct {
		file string
		env  []string
		want string
	}{
		{"{}", []string{"APP_OUTBOX_BATCH_SIZE=-1"}, "APP_OUTBOX_BATCH_SIZE=-1"},
		{"outbox:\n  batch_size: -1\n", nil, "outbox.batch_size=-1"},
		{"{}", []string{"APP_OUTBOX_BACKOFF_BASE=2s", "APP_OUTBOX_BACKOFF_MAX=1s"}, "APP_OUTBOX_BACKOFF_MAX=1s: want at least APP_OUTBOX_BACKOFF_BASE (2s)"},
		{"{}", []string{"APP_TASKS_PROBE_BACKOFF_MAX=0s"}, "APP_TASKS_PROBE_BACKOFF_MAX=0s must be positive"},
	}
	for _, c := range cases {
		_, err := Load(writeFile(t, c.file), c.env)
		if !isConfigError(err) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: got %v, want exit 78 with %q", c.env, err, c.want)
		}
	}
}

// A typo in the file names its line and the nearest known key.
func TestUnknownKeySuggestsNearestKeyAndLine(t *testing.T) {
	t.Parallel()
	cases := []struct{ file, want string }{
		{"log:\n  level: info\nlock:\n  lease_tll: 30s\n", `:4: unknown key "lock.lease_tll" (did you mean lock.lease_ttl?)`},
		{"databse:\n  url: x\n", `:2: unknown key "databse.url" (did you mean database.url?)`},
		{"lease_ttl: 30s\n", `:1: unknown key "lease_ttl" (did you mean inbox.lease_ttl or lock.lease_ttl?)`},
		{"jobs:\n  - name: a\n    kind: sql\n    delay: 1s\n    sql: SELECT 1\n    dealy: 2s\n", `:6: jobs[0] "a": unknown key "dealy" (did you mean delay?)`},
	}
	for _, c := range cases {
		path := writeFile(t, c.file)
		_, err := Load(path, nil)
		if !isConfigError(err) || !strings.Contains(err.Error(), path+c.want) {
			t.Errorf("%q: got %v, want %q", c.file, err, path+c.want)
		}
	}
	_, err := Load(writeFile(t, "zzz: 1\n"), nil)
	if err == nil || strings.Contains(err.Error(), "did you mean") {
		t.Errorf("a key like no other should get no suggestion: %v", err)
	}
}

// An APP_* variable within two edits of a setting's is that setting
// misspelt: it stops the start (exit 78) naming the setting meant, since
// running without it would leave the setting at its default. One further
// from every setting is not an error (other software sets APP_ variables
// too) but is warned about when it still looks like one; others pass
// quietly.
func TestMisspeltEnvironmentVariable(t *testing.T) {
	t.Parallel()
	for name, want := range map[string]string{
		"APP_OUTBOX_SINKK=webhook":         "APP_OUTBOX_SINKK is not a setting (did you mean APP_OUTBOX_SINK?)",
		"APP_LOCK_LEASE_TLL=5s":            "APP_LOCK_LEASE_TLL is not a setting (did you mean APP_LOCK_LEASE_TTL?)",
		"APP_OUTBOX_BACTH_SZE=10":          "APP_OUTBOX_BACTH_SZE is not a setting (did you mean APP_OUTBOX_BATCH_SIZE?)",
		"APP_CONFIG_FIEL=/etc/worker.yaml": "APP_CONFIG_FIEL is not a setting (did you mean APP_CONFIG_FILE?)",
	} {
		_, err := Load(writeFile(t, "{}"), []string{name})
		if !isConfigError(err) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v; want a configuration error saying %q", name, err, want)
		}
	}

	cfg, err := Load("", []string{"APP_LOCK_LEASE_TTL_SECONDS=5", "APP_SERVICE_HOST=10.0.0.1", "APP_PORT_9090_TCP_ADDR=10.0.0.1",
		"APP_CONFIG_FILE=", "APP_INBOX_SOURCES_ORDERS_NATS_PASSWORD=p"})
	if err != nil {
		t.Fatal(err)
	}
	out := strings.Join(cfg.MisspeltEnv(), "\n")
	if !strings.Contains(out, "APP_LOCK_LEASE_TTL_SECONDS is not a setting and is ignored (did you mean APP_LOCK_LEASE_TTL?)") {
		t.Errorf("no warning for the variable like a setting:\n%s", out)
	}
	for _, quiet := range []string{"APP_SERVICE_HOST", "APP_PORT_9090", "APP_CONFIG_FILE", "APP_INBOX_SOURCES"} {
		if strings.Contains(out, quiet) {
			t.Errorf("warned about %s, which is no typo:\n%s", quiet, out)
		}
	}
}

// The settings' variables are more than maxTypoEdits apart, so a real one
// is never taken for another's misspelling; a new key that breaks this
// needs another name.
func TestSettingsAreFarApart(t *testing.T) {
	t.Parallel()
	names := []string{configFileEnv}
	for _, s := range settings() {
		names = append(names, s.Env())
	}
	for i, a := range names {
		for _, b := range names[i+1:] {
			if d := editDistance(a, b); d <= maxTypoEdits {
				t.Errorf("%s and %s are %d edits apart; a misspelling of one could be the other", a, b, d)
			}
		}
	}
}

// config print shows what the worker will use: each job with its
// effective defaults and only the keys of its kind, and instance.id as how
// it is derived, the same on every call.
func TestPrintConfigShowsEffectiveValues(t *testing.T) {
	t.Parallel()
	path := writeFile(t, `
jobs:
  - {name: a, kind: sql, sql: SELECT 1, delay: 1m}
  - {name: b, kind: http, url: "https://x.test/p", delay: 1m, timeout: 3s, lease_ttl: 9s, enabled: false, method: post}
`)
	print := func() string {
		cfg, err := Load(path, []string{"APP_LOCK_LEASE_TTL=40s"})
		if err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		if err := Print(&out, cfg); err != nil {
			t.Fatal(err)
		}
		return out.String()
	}
	first := print()
	if second := print(); second != first {
		t.Errorf("two calls print different configurations:\n%s\n---\n%s", first, second)
	}
	var doc struct {
		Instance struct{ ID string }
		Jobs     []map[string]any
	}
	if err := yamlv3.Unmarshal([]byte(first), &doc); err != nil {
		t.Fatal(err)
	}
	host, _ := os.Hostname()
	if doc.Instance.ID != host+"-<random>" || !strings.Contains(first, "# derived at each start") {
		t.Errorf("instance.id printed as %q, want %q with a comment saying how it is derived", doc.Instance.ID, host+"-<random>")
	}
	want := []map[string]any{
		{"name": "a", "kind": "sql", "delay": "1m0s", "initial_delay": "0s", "timeout": "5m0s", "lease_ttl": "40s", "enabled": true, "sql": "SELECT 1"},
		{"name": "b", "kind": "http", "delay": "1m0s", "initial_delay": "0s", "timeout": "3s", "lease_ttl": "9s", "enabled": false, "url": "https://x.test/p", "method": "POST"},
	}
	if !reflect.DeepEqual(doc.Jobs, want) {
		t.Errorf("jobs printed as\n%v\nwant\n%v", doc.Jobs, want)
	}
}

// TestMaxInFlightFollowsTheSink: left unset, outbox.max_in_flight is the
// sink's default (more for a broker than for a webhook receiver), and a
// value that is set wins.
func TestMaxInFlightFollowsTheSink(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		env  []string
		want int
	}{
		{[]string{"APP_OUTBOX_SINK=log"}, 64},
		{[]string{"APP_OUTBOX_SINK=webhook", "APP_OUTBOX_WEBHOOK_URL=http://127.0.0.1:1/hook"}, 64},
		{[]string{"APP_OUTBOX_SINK=nats"}, 256},
		{[]string{"APP_OUTBOX_SINK=rabbitmq"}, 256},
		{[]string{"APP_OUTBOX_SINK=kafka"}, 256},
		{[]string{"APP_OUTBOX_SINK=nats", "APP_OUTBOX_MAX_IN_FLIGHT=32"}, 32},
	} {
		cfg, err := Load(writeFile(t, "{}\n"), c.env)
		if err != nil {
			t.Fatalf("%v: %v", c.env, err)
		}
		if got := cfg.Outbox.MaxInFlight; got != c.want {
			t.Errorf("%v: max_in_flight = %d, want %d", c.env, got, c.want)
		}
	}
}

// isConfigError is what makes the worker exit 78.
func isConfigError(err error) bool {
	var ce *Error
	return errors.As(err, &ce)
}

func TestRedisKeyPrefixDefault(t *testing.T) {
	if defaultRedisKeyPrefix != lock.DefaultRedisKeyPrefix {
		t.Errorf("lock.redis.key_prefix defaults to %q, the Redis provider to %q", defaultRedisKeyPrefix, lock.DefaultRedisKeyPrefix)
	}
}
