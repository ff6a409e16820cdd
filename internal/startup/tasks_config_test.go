package startup

import (
	"bytes"
	"strings"
	"testing"

	"github.com/worker-dev/worker/internal/config"
)

// config print shows each task kind with its defaults filled in and only the
// keys of its type, with credentials in URLs and headers masked.
func TestPrintConfigShowsTaskKindsMasked(t *testing.T) {
	t.Parallel()
	cfg, err := LoadConfig(writeFile(t, `
tasks:
  queues:
    mail: {max_workers: 2, max_backlog: 50}
  kinds:
    - name: send-receipt
      type: http
      queue: mail
      url: https://user:pw-in-url@mail.internal/receipts?token=tok-in-query
      headers: {Authorization: Bearer tok-in-header}
    - name: close-order
      type: sql
      sql: UPDATE orders SET closed = true WHERE id = ($1->>'order')::bigint
`), nil)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := config.Print(&out, cfg.Config); err != nil {
		t.Fatal(err)
	}
	printed := out.String()
	for _, secret := range []string{"pw-in-url", "tok-in-query", "tok-in-header"} {
		if strings.Contains(printed, secret) {
			t.Errorf("config print shows %q:\n%s", secret, printed)
		}
	}
	for _, want := range []string{"max_workers: 2", "max_backlog: 50", "Authorization: xxxxx",
		"- name: close-order\n      type: sql\n      queue: default\n      timeout: 1m0s\n      max_attempts: 3\n      sql: "} {
		if !strings.Contains(printed, want) {
			t.Errorf("config print lacks %q:\n%s", want, printed)
		}
	}
}

// A queue key left out gets its default; only a written 0 makes the backlog
// unbounded. Raising the default queue's max_workers once turned its
// backlog bound off.
func TestQueueKeysLeftOutGetTheirDefaults(t *testing.T) {
	t.Parallel()
	cfg, err := LoadConfig(writeFile(t, `
tasks:
  queues:
    default: {max_workers: 20}
    bulk: {max_backlog: 50}
    open: {max_workers: 1, max_backlog: 0}
`), nil)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][2]int{"default": {20, 10000}, "bulk": {10, 50}, "open": {1, 0}}
	for name, w := range want {
		q := cfg.Tasks.Queues[name]
		if got := [2]int{q.Workers(), q.Backlog()}; got != w {
			t.Errorf("queue %s: max_workers, max_backlog = %v, want %v", name, got, w)
		}
	}
}
