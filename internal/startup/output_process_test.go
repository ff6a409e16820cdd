package startup_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/jobs"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/tasks"
)

// outputCommands are the commands that list or count: each takes
// --output table|json (docs/operations.md, "Output formats").
var outputCommands = []struct {
	cmd        string
	emptyTable string     // the table's last line on an empty database
	newJSON    func() any // the documented shape its JSON decodes into
}{
	{"jobs list", "0 job(s)", func() any { return new([]jobs.StatusJSON) }},
	{"outbox stats", "oldest unfinished event: none", func() any { return new(outbox.StatsJSON) }},
	{"outbox dead list", "0 DEAD event(s)", func() any { return new([]outbox.DeadEventJSON) }},
	{"inbox stats", "DEAD: 0 (worker inbox dead list); RECOVERY_REQUIRED: 0 (worker inbox recovery list)", func() any { return new(inbox.StatsJSON) }},
	{"inbox dead list", "0 DEAD message(s)", func() any { return new([]inbox.EntryJSON) }},
	{"inbox recovery list", "0 RECOVERY_REQUIRED message(s)", func() any { return new([]inbox.EntryJSON) }},
	{"tasks list", "0 task(s)", func() any { return new([]tasks.Task) }},
	{"tasks dead list", "0 dead-lettered task(s)", func() any { return new([]tasks.Task) }},
}

func isList(newJSON func() any) bool { return strings.HasPrefix(fmt.Sprintf("%T", newJSON()), "*[]") }

// On an empty database every list says so the same way: a table ending
// with "0 <what>(s)", JSON that is [] (never null or nothing). A bad
// --output exits 64 and names the formats.
func TestOutputOfEveryListAndStatsCommandOnEmptyDatabase(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	env := []string{"APP_DATABASE_URL=" + db.URL}
	for i, c := range outputCommands {
		args := strings.Fields(c.cmd)
		formats := [][]string{nil, {"--output", "table"}}
		if i == 0 {
			formats = append(formats, []string{"--output", "text"}) // the table's former name
		}
		for _, format := range formats {
			code, out, stderr := runCLI(t, env, append(args, format...)...)
			lines := strings.Split(strings.TrimSpace(out), "\n")
			if code != 0 || lines[len(lines)-1] != c.emptyTable {
				t.Errorf("worker %s %v: exit %d, last line %q; want 0 and %q\n%s", c.cmd, format, code, lines[len(lines)-1], c.emptyTable, stderr)
			}
		}
		code, out, stderr := runCLI(t, env, append(args, "--output", "json")...)
		if code != 0 {
			t.Errorf("worker %s --output json: exit %d\n%s", c.cmd, code, stderr)
		}
		if isList(c.newJSON) && out != "[]\n" {
			t.Errorf("worker %s --output json on nothing printed %q, want []", c.cmd, out)
		}
		if err := decodeStrict([]byte(out), c.newJSON()); err != nil {
			t.Errorf("worker %s --output json: %v\n%s", c.cmd, err, out)
		}
		code, _, stderr = runCLI(t, env, append(args, "--output", "yaml")...)
		if code != 64 || !strings.Contains(stderr, `\"yaml\" is not an output format; want table or json`) {
			t.Errorf("worker %s --output yaml: exit %d, want 64 naming the formats\n%s", c.cmd, code, stderr)
		}
	}
}

// Each command's JSON is the shape docs/operations.md shows: it decodes
// into the documented struct with no key left over, and has the same keys,
// at every level, as the page's example, as the example has as the struct.
func TestJSONOutputIsTheDocumentedShape(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	// One row of each kind, with every optional value set, so that no key
	// of the output is null where the example shows one filled in.
	for _, sql := range []string{
		`INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload, headers)
		 VALUES ('order', '42', 'order.paid', '{"amount": 1200}', '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}'),
		        ('order', '43', 'order.paid', '{"amount": 80}', '{}')`,
		`UPDATE outbox_delivery SET status = 'DEAD', attempts = 3, last_error = 'webhook answered 422', dead_at = now() WHERE aggregate_id = '42'`,
		`INSERT INTO inbox_message (consumer, msg_source, msg_id, state, attempts, msg_type, origin, headers, body, last_error, finished_at, owner, lease_token, lease_until)
		 VALUES ('orders', 'https://shop.example/orders', 'ord-17', 'DEAD', 5, 'order.created', '/hooks/orders', '{"content-type": "application/json"}', '{"id": 17}', 'permanent: unknown customer', now(), NULL, NULL, NULL),
		        ('orders', 'https://shop.example/orders', 'ord-18', 'RECOVERY_REQUIRED', 1, 'order.created', '/hooks/orders', '{}', '{"id": 18}', 'lease expired', now(), NULL, NULL, NULL),
		        ('orders', 'https://shop.example/orders', 'ord-19', 'RECEIVED', 0, 'order.created', '/hooks/orders', '{}', '{"id": 19}', NULL, NULL, 'w-1', 1, now() + interval '30 seconds')`,
		`INSERT INTO job_state (name, delay, last_started_at, last_finished_at, last_outcome, last_instance, last_token, next_due_at)
		 VALUES ('cleanup', '30 seconds', now() - interval '10 seconds', now() - interval '9 seconds', 'success', 'w-1', 7, now() + interval '21 seconds')`,
		`INSERT INTO river_job (args, kind, max_attempts, queue, state, attempt, finalized_at, errors)
		 VALUES ('{"to": "ana@example.com"}', 'send_receipt', 3, 'default', 'discarded', 3, now(),
		         ARRAY['{"at": "2026-12-06T07:30:00Z", "attempt": 3, "error": "smtp: 550", "trace": ""}'::jsonb])`,
	} {
		if _, err := db.Pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	examples := documentedJSON(t)
	env := []string{"APP_DATABASE_URL=" + db.URL}
	for _, c := range outputCommands {
		example, ok := examples[c.cmd]
		if !ok {
			t.Errorf("docs/operations.md shows no example of `worker %s --output json`", c.cmd)
			continue
		}
		if err := decodeStrict(example, c.newJSON()); err != nil {
			t.Errorf("the example of `worker %s --output json` is not its struct: %v", c.cmd, err)
		}
		code, out, stderr := runCLI(t, env, append(strings.Fields(c.cmd), "--output", "json")...)
		if code != 0 {
			t.Errorf("worker %s --output json: exit %d\n%s", c.cmd, code, stderr)
			continue
		}
		if err := decodeStrict([]byte(out), c.newJSON()); err != nil {
			t.Errorf("worker %s --output json is not its documented struct: %v\n%s", c.cmd, err, out)
		}
		var got, want any
		if err := json.Unmarshal([]byte(out), &got); err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(example, &want); err != nil {
			t.Fatal(err)
		}
		for _, diff := range shapeDiff(c.cmd, want, got) {
			t.Errorf("worker %s --output json differs from docs/operations.md: %s\n%s", c.cmd, diff, out)
		}
	}
}

// The commands that only read the database need none of a source's or
// sink's credentials; run's checks (config print's here) still want them.
func TestReadOnlyCommandsNeedNoCredentials(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	source := writeConfig(t, `inbox:
  sources:
    - {name: orders, kind: webhook, handler: {kind: sql, sql: "SELECT 1"}}
`)
	sink := writeConfig(t, "outbox:\n  sink: webhook\n")
	for _, c := range []struct {
		config string
		args   []string
		want   string
	}{
		{source, []string{"inbox", "stats"}, "orders "},
		{source, []string{"inbox", "stats", "--output", "json"}, `"orders": {`},
		{source, []string{"inbox", "dead", "list"}, "0 DEAD message(s)"},
		{source, []string{"inbox", "recovery", "list"}, "0 RECOVERY_REQUIRED message(s)"},
		{sink, []string{"outbox", "stats"}, "oldest unfinished event: none"},
		{sink, []string{"outbox", "dead", "list"}, "0 DEAD event(s)"},
	} {
		code, out, stderr := runCLI(t, []string{"APP_DATABASE_URL=" + db.URL, c.config}, c.args...)
		if code != 0 || !strings.Contains(out, c.want) {
			t.Errorf("worker %s: exit %d, want 0 and %q\n%s%s", strings.Join(c.args, " "), code, c.want, out, stderr)
		}
	}
	for _, c := range []struct{ config, want string }{
		{source, "inbox.sources[0] (orders)"},
		{sink, "outbox.webhook.url"},
	} {
		code, _, stderr := runCLI(t, []string{"APP_DATABASE_URL=" + db.URL, c.config}, "config", "print")
		if code != 78 || !strings.Contains(stderr, c.want) {
			t.Errorf("config print: exit %d, want 78 naming %s\n%s", code, c.want, stderr)
		}
	}
}

// documentedJSON returns docs/operations.md's JSON examples by the command
// the line before each names: "`worker outbox stats --output json`".
func documentedJSON(t *testing.T) map[string][]byte {
	t.Helper()
	page, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := regexp.MustCompile("(?s)\n([^\n]+)\n\n```json\n(.*?)\n```").FindAllSubmatch(page, -1)
	names := regexp.MustCompile("`worker ([a-z ]+) --output json`")
	out := map[string][]byte{}
	for _, b := range blocks {
		for _, n := range names.FindAllSubmatch(b[1], -1) {
			out[string(n[1])] = b[2]
		}
	}
	return out
}

// decodeStrict decodes one JSON document into v, refusing keys v lacks.
func decodeStrict(data []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if dec.More() {
		return errors.New("more than one JSON document")
	}
	return nil
}

// freeForm are keys whose value is the user's data (an event's payload, a
// task's args): only their kind is compared.
var freeForm = []string{"payload", "headers", "body", "args", "metadata"}

// shapeDiff lists where got and want differ in the kind of a value or the
// keys of an object, at every level; a list is compared by its first item.
func shapeDiff(path string, want, got any) []string {
	kind := func(v any) string { return fmt.Sprintf("%T", v) }
	if kind(want) != kind(got) {
		return []string{fmt.Sprintf("%s: %s, documented %s", path, kind(got), kind(want))}
	}
	var diffs []string
	switch w := want.(type) {
	case map[string]any:
		g := got.(map[string]any)
		for k := range w {
			if _, ok := g[k]; !ok {
				diffs = append(diffs, fmt.Sprintf("%s: no key %q", path, k))
			}
		}
		for k := range g {
			if _, ok := w[k]; !ok {
				diffs = append(diffs, fmt.Sprintf("%s: undocumented key %q", path, k))
			} else if !slices.Contains(freeForm, k) {
				diffs = append(diffs, shapeDiff(path+"."+k, w[k], g[k])...)
			}
		}
	case []any:
		g := got.([]any)
		if len(w) == 0 || len(g) == 0 {
			return []string{fmt.Sprintf("%s: %d item(s), documented %d; want some of each", path, len(g), len(w))}
		}
		diffs = append(diffs, shapeDiff(path+"[0]", w[0], g[0])...)
	}
	return diffs
}
