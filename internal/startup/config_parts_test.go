package startup

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The configuration checks that need the parts run builds (sinks, the
// lock provider, the built-in jobs) or the exit codes, as run loads it.

func TestStartupSafety(t *testing.T) {
	load := func(env ...string) *runConfig {
		cfg, err := LoadConfig(writeFile(t, "{}"), env)
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	cases := []struct {
		env  []string
		want int
		msg  string
	}{
		{nil, ExitOK, ""},
		{[]string{"APP_MULTI_INSTANCE_ENABLED=true"}, ExitUnsafe, "set APP_LOCK_PROVIDER=postgres"},
		{[]string{"APP_MULTI_INSTANCE_ENABLED=true", "APP_LOCK_PROVIDER=inprocess"}, ExitUnsafe, "APP_LOCK_PROVIDER=postgres"},
		{[]string{"APP_MULTI_INSTANCE_ENABLED=true", "APP_LOCK_PROVIDER=postgres"}, ExitOK, ""},
		{[]string{"APP_MULTI_INSTANCE_ENABLED=true", "APP_LOCK_PROVIDER=redis"}, ExitOK, ""},
		{[]string{"APP_LOCK_PROVIDER=postgres"}, ExitOK, ""},
	}
	for _, c := range cases {
		err := CheckLockProvider(load(c.env...))
		if ExitCode(err) != c.want || (c.msg != "" && !strings.Contains(err.Error(), c.msg)) {
			t.Errorf("%v: got %v (exit %d), want exit %d mentioning %q", c.env, err, ExitCode(err), c.want, c.msg)
		}
	}

	multi := load("APP_MULTI_INSTANCE_ENABLED=true", "APP_LOCK_PROVIDER=postgres")
	err := CheckLockStore(t.Context(), multi, func(_ context.Context) error { return errors.New(`relation "worker_lock" does not exist`) })
	if ExitCode(err) != ExitUnsafe || !strings.Contains(err.Error(), "APP_DATABASE_MIGRATE_ON_START") {
		t.Errorf("unusable store: got %v", err)
	}
	if err := CheckLockStore(t.Context(), multi, func(context.Context) error { return nil }); err != nil {
		t.Errorf("usable store: %v", err)
	}
}

// A configured job named like a built-in one ("outbox-partitions", or
// "lock-reaper" with the postgres provider) is invalid configuration: exit
// 78 naming the job, not an internal error (70) after connecting.
func TestJobNamedLikeBuiltinIsConfigError(t *testing.T) {
	_, err := LoadConfig(writeFile(t, "jobs:\n  - {name: outbox-partitions, kind: sql, sql: SELECT 1, delay: 1m}\n"), nil)
	if ExitCode(err) != ExitConfig || !strings.Contains(err.Error(), "outbox-partitions") {
		t.Fatalf("got exit %d: %v; want 78 naming the job", ExitCode(err), err)
	}
}

// A sink's settings given while another sink is selected stop the start,
// naming both: the selected sink would publish, and mark published, the
// events meant for the other. Defaults written out, as configs/worker.yaml
// does, are not "given".
func TestOtherSinksSettingsStopTheStart(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, yaml string
		env        []string
		want       []string
	}{
		{"webhook url with the default log sink", "{}", []string{"APP_OUTBOX_WEBHOOK_URL=https://hooks.example/x"},
			[]string{`APP_OUTBOX_WEBHOOK_URL is set, but outbox.sink="log" (the default): the webhook sink's settings apply only with outbox.sink=webhook`}},
		{"nats section with sink webhook", "outbox:\n  nats:\n    stream: events\n    publish_timeout: 3s\n",
			[]string{"APP_OUTBOX_SINK=webhook", "APP_OUTBOX_WEBHOOK_URL=https://hooks.example/x"},
			[]string{`outbox.nats.stream, outbox.nats.publish_timeout are set, but APP_OUTBOX_SINK="webhook": the nats sink's settings apply only with APP_OUTBOX_SINK=nats`}},
		{"river routes with sink kafka", "outbox:\n  sink: kafka\n  kafka: {brokers: k1:9092}\n  river:\n    routes: {\"*\": k}\n", nil,
			[]string{`outbox.river.routes is set, but outbox.sink="kafka": the river sink's settings apply only with outbox.sink=river`}},
	}
	for _, c := range cases {
		_, err := LoadConfig(writeFile(t, c.yaml), c.env)
		if ExitCode(err) != ExitConfig {
			t.Errorf("%s: %v (exit %d), want exit 78", c.name, err, ExitCode(err))
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %v\nwant %q", c.name, err, w)
			}
		}
	}

	// Every key at its default, as the commented file lists them.
	if _, err := LoadConfig("../../configs/worker.yaml", nil); err != nil {
		t.Errorf("configs/worker.yaml: %v", err)
	}
	if _, err := LoadConfig(writeFile(t, "outbox:\n  webhook: {timeout: 10s}\n  nats: {url: nats://127.0.0.1:4222}\n"), nil); err != nil {
		t.Errorf("defaults written out: %v", err)
	}
}

// A bad webhook URL is shown as config print shows it: no credentials, no
// query string.
func TestBadWebhookURLIsMasked(t *testing.T) {
	t.Parallel()
	for _, raw := range []string{"ftp://bot:pass-word@hooks.test/x?token=query-token", "https://hooks.test/%zz?token=query-token"} {
		_, err := LoadConfig(writeFile(t, "{}"), []string{"APP_OUTBOX_SINK=webhook", "APP_OUTBOX_WEBHOOK_URL=" + raw})
		if ExitCode(err) != ExitConfig {
			t.Fatalf("%s: got %v, want exit 78", raw, err)
		}
		for _, secret := range []string{"query-token", "pass-word", "bot"} {
			if strings.Contains(err.Error(), secret) {
				t.Errorf("message leaks %q: %v", secret, err)
			}
		}
		if !strings.Contains(err.Error(), "?xxxxx") {
			t.Errorf("message should show where the masked query was: %v", err)
		}
	}
}

func TestInvalidConfig(t *testing.T) {
	cases := []struct {
		name, file string
		env        []string
		want       []string // all must appear in the message
	}{
		{"unparsable duration", "{}", []string{"APP_LOCK_WAIT_TIME=banana"}, []string{"APP_LOCK_WAIT_TIME", "banana", "3s"}},
		{"duration in file", "shutdown:\n  timeout: soon\n", nil, []string{"shutdown.timeout", "soon"}},
		{"zero timeout", "{}", []string{"APP_SHUTDOWN_TIMEOUT=0s"}, []string{"APP_SHUTDOWN_TIMEOUT", "positive"}},
		{"negative timeout", "{}", []string{"APP_DATABASE_CONNECT_TIMEOUT=-1s"}, []string{"APP_DATABASE_CONNECT_TIMEOUT", "positive"}},
		{"ttl below wait", "{}", []string{"APP_LOCK_LEASE_TTL=2s", "APP_LOCK_WAIT_TIME=3s"}, []string{"APP_LOCK_LEASE_TTL", "APP_LOCK_WAIT_TIME", "shorter"}},
		{"unknown provider", "{}", []string{"APP_LOCK_PROVIDER=zookeeper"}, []string{"APP_LOCK_PROVIDER", "zookeeper", "postgres", "inprocess"}},
		{"unknown key", "lock:\n  wiat_time: 3s\n", nil, []string{"lock.wiat_time", "unknown key"}},
		{"unknown top-level key", "databse:\n  url: x\n", nil, []string{"databse.url", "unknown key"}},
		{"unknown job key", "jobs:\n  - name: a\n    kind: sql\n    delay: 1s\n    sql: SELECT 1\n    dealy: 2s\n", nil, []string{`"a"`, "dealy"}},
		{"bad int", "{}", []string{"APP_ASYNC_EXECUTOR_MAX_SIZE=ten"}, []string{"APP_ASYNC_EXECUTOR_MAX_SIZE", "ten"}},
		{"bad bool", "{}", []string{"APP_MULTI_INSTANCE_ENABLED=yes please"}, []string{"APP_MULTI_INSTANCE_ENABLED", "true or false"}},
		{"bad level", "{}", []string{"APP_LOG_LEVEL=loud"}, []string{"APP_LOG_LEVEL", "loud", "debug"}},
		{"bad format", "{}", []string{"APP_LOG_FORMAT=xml"}, []string{"APP_LOG_FORMAT", "json"}},
		{"zero executor", "{}", []string{"APP_ASYNC_EXECUTOR_MAX_SIZE=0"}, []string{"APP_ASYNC_EXECUTOR_MAX_SIZE"}},
		{"bad http addr", "{}", []string{"APP_HTTP_ADDR=9090"}, []string{"APP_HTTP_ADDR", "9090"}},
		{"job lease below wait", "jobs:\n  - {name: a, kind: sql, sql: SELECT 1, delay: 1m, lease_ttl: 2s}\n", []string{"APP_LOCK_WAIT_TIME=3s"},
			[]string{`jobs[0] "a"`, "lease_ttl 2s", "APP_LOCK_WAIT_TIME"}},
		{"bad http port", "{}", []string{"APP_HTTP_ADDR=:abc"}, []string{"APP_HTTP_ADDR", "abc", "not a port"}},
		{"relays use every connection", "{}", []string{"APP_DATABASE_MAX_CONNS=4", "APP_OUTBOX_RELAYS=4"}, []string{"APP_DATABASE_MAX_CONNS", "APP_OUTBOX_RELAYS", "exceed"}},
		{"bad database url", "{}", []string{"APP_DATABASE_URL=postgres://u:hunter2@[::1"}, []string{"APP_DATABASE_URL"}},
		{"bad redis url", "{}", []string{"APP_LOCK_PROVIDER=redis", "APP_LOCK_REDIS_URL=redis://u:hunter2@[::1"}, []string{"APP_LOCK_REDIS_URL", "rediss://"}},
		{"redis url scheme", "{}", []string{"APP_LOCK_PROVIDER=redis", "APP_LOCK_REDIS_URL=http://u:hunter2@cache:6379/0"}, []string{"APP_LOCK_REDIS_URL", "scheme"}},
		{"redis database number", "{}", []string{"APP_LOCK_PROVIDER=redis", "APP_LOCK_REDIS_URL=redis://:hunter2@cache:6379/one"}, []string{"APP_LOCK_REDIS_URL", "database number"}},
		{"redis tls files without rediss", "{}", []string{"APP_LOCK_PROVIDER=redis", "APP_LOCK_REDIS_URL=redis://:hunter2@cache:6379/0", "APP_LOCK_REDIS_TLS_CA_FILE=/ca.pem"},
			[]string{"rediss://"}},
		{"redis cert without key", "{}", []string{"APP_LOCK_PROVIDER=redis", "APP_LOCK_REDIS_URL=rediss://cache:6379/0", "APP_LOCK_REDIS_TLS_CERT_FILE=/c.pem"},
			[]string{"APP_LOCK_REDIS_TLS_CERT_FILE", "tls_key_file"}},
		{"inbox sql handler with external effects", "inbox:\n  sources:\n    - {name: a, kind: webhook, effects: external, handler: {kind: sql, sql: SELECT 1}}\n", nil,
			[]string{"inbox.sources[0].effects", "external", "transactional"}},
		{"inbox effects unknown", "inbox:\n  sources:\n    - {name: a, kind: webhook, effects: maybe, handler: {kind: sql, sql: SELECT 1}}\n", nil,
			[]string{"inbox.sources[0].effects", "maybe", "transactional or external"}},
		{"inbox concurrency zero", "inbox:\n  sources:\n    - {name: a, kind: webhook, concurrency: 0, handler: {kind: sql, sql: SELECT 1}}\n", nil,
			[]string{"inbox.sources[0].concurrency=0", "1 to 64"}},
		{"redis ca file missing", "{}", []string{"APP_LOCK_PROVIDER=redis", "APP_LOCK_REDIS_URL=rediss://cache:6379/0", "APP_LOCK_REDIS_TLS_CA_FILE=/nonexistent/ca.pem"},
			[]string{"APP_LOCK_REDIS_TLS_CA_FILE", "/nonexistent/ca.pem"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := LoadConfig(writeFile(t, c.file), c.env)
			if ExitCode(err) != ExitConfig {
				t.Fatalf("exit code %d (err %v), want %d", ExitCode(err), err, ExitConfig)
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("message %q does not mention %q", err, w)
				}
			}
			if strings.Contains(err.Error(), "hunter2") {
				t.Errorf("message leaks the password: %q", err)
			}
		})
	}
}

func writeFile(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "worker.yaml")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// A sink's section names the variable a bad value came from, though the
// sink's own check knows only the key.
func TestSinkErrorsNameTheEnvironmentVariable(t *testing.T) {
	t.Parallel()
	for env, want := range map[string]string{
		"APP_OUTBOX_WEBHOOK_URL=ftp://h/x":        `APP_OUTBOX_WEBHOOK_URL "ftp://h/x"`,
		"APP_OUTBOX_WEBHOOK_URL=http://h:99999/x": `APP_OUTBOX_WEBHOOK_URL "http://h:99999/x": port 99999: want a port from 1 to 65535`,
	} {
		_, err := LoadConfig(writeFile(t, "{}"), []string{"APP_OUTBOX_SINK=webhook", env})
		if ExitCode(err) != ExitConfig || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: got %v, want exit 78 with %q", env, err, want)
		}
	}
}
