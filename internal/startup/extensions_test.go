package startup

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/jobs"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
)

func testExtensions() Extensions {
	return Extensions{
		Jobs: func(*pgxpool.Pool) []jobs.Spec {
			return []jobs.Spec{{Job: jobs.Func("refresh-cache", func(context.Context) error { return nil }), Delay: time.Minute}}
		},
		Sinks: map[string]func(context.Context) (outbox.Sink, error){
			"audit": func(context.Context) (outbox.Sink, error) { return outbox.NewLogSink(&bytes.Buffer{}), nil },
		},
	}
}

// A program's sink is a value of outbox.sink, and only in that program.
func TestExtensionSinkIsAnOutboxSink(t *testing.T) {
	env := []string{"APP_OUTBOX_SINK=audit"}
	cfg, err := loadConfig(writeFile(t, "{}\n"), env, testExtensions())
	if err != nil {
		t.Fatal(err)
	}
	s, err := newSink(context.Background(), cfg, nil, nil)
	if err != nil || s == nil {
		t.Fatalf("newSink = %v, %v; want the program's sink", s, err)
	}
	_, err = LoadConfig(writeFile(t, "{}\n"), env)
	if ExitCode(err) != ExitConfig || !strings.Contains(err.Error(), `"audit"`) {
		t.Fatalf("stock worker with outbox.sink=audit: %v, want exit 78 naming it", err)
	}
}

// A program's job names are taken, like the built-in ones: the name is
// the lease key.
func TestExtensionJobNameIsTaken(t *testing.T) {
	path := writeFile(t, "jobs:\n  - name: refresh-cache\n    kind: sql\n    delay: 1m\n    sql: SELECT 1\n")
	_, err := loadConfig(path, nil, testExtensions())
	if ExitCode(err) != ExitConfig || !strings.Contains(err.Error(), "refresh-cache") {
		t.Fatalf("configured job named like a Go job: %v, want exit 78 naming it", err)
	}
}

// A program cannot replace a built-in sink.
func TestExtensionSinkCannotShadowABuiltIn(t *testing.T) {
	ext := Extensions{Sinks: map[string]func(context.Context) (outbox.Sink, error){outboxconfig.SinkWebhook: nil}}
	if err := ext.Check(); ExitCode(err) != ExitConfig || !strings.Contains(err.Error(), `"webhook"`) {
		t.Fatalf("Check = %v; want exit 78 naming the sink", err)
	}
}

// A Go job the scheduler would refuse stops the program before it
// connects to anything, with exit 78 naming the job and the mistake.
func TestExtensionJobMistakeIsAConfigError(t *testing.T) {
	ext := Extensions{Jobs: func(*pgxpool.Pool) []jobs.Spec {
		return []jobs.Spec{{Job: jobs.Func("no-delay", func(context.Context) error { return nil })}}
	}}
	if err := ext.Check(); ExitCode(err) != ExitConfig ||
		!strings.Contains(err.Error(), `"no-delay"`) || !strings.Contains(err.Error(), "delay") {
		t.Fatalf("Check = %v; want exit 78 naming the job and its delay", err)
	}
}

// A nil OnReady function is a programming mistake, refused before anything
// starts.
func TestExtensionNilOnReadyIsAConfigError(t *testing.T) {
	ext := Extensions{OnReady: []func(context.Context){nil}}
	if err := ext.Check(); ExitCode(err) != ExitConfig || !strings.Contains(err.Error(), "OnReady") {
		t.Fatalf("Check = %v; want exit 78 naming OnReady", err)
	}
}

// A program's inbox handler is a handler kind, only in that program, and
// cannot take a built-in kind's name.
func TestExtensionInboxHandler(t *testing.T) {
	yaml := "inbox:\n  sources:\n    - {name: hooks, kind: webhook, webhook: {secret: whsec_c2VjcmV0}, handler: {kind: receipts}}\n"
	ext := Extensions{InboxHandlers: map[string]inbox.Handler{
		"receipts": inbox.HandlerFunc(func(context.Context, pgx.Tx, inbox.Message) error { return nil }),
	}}
	cfg, err := loadConfig(writeFile(t, yaml), nil, ext)
	if err != nil {
		t.Fatal(err)
	}
	if h := cfg.inboxHandler(cfg.Inbox.Sources[0]); h == nil {
		t.Fatal("the source has no handler; want the program's")
	}
	_, err = LoadConfig(writeFile(t, yaml), nil)
	if ExitCode(err) != ExitConfig || !strings.Contains(err.Error(), `"receipts"`) {
		t.Fatalf("stock worker with handler.kind=receipts: %v, want exit 78 naming it", err)
	}
	ext = Extensions{InboxHandlers: map[string]inbox.Handler{inboxconfig.HandlerSQL: ext.InboxHandlers["receipts"]}}
	if err := ext.Check(); ExitCode(err) != ExitConfig || !strings.Contains(err.Error(), `"sql"`) {
		t.Fatalf("Check = %v; want exit 78 naming the handler", err)
	}
}
