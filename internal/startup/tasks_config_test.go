package startup

import (
	"bytes"
	"strings"
	"testing"
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
	if err := PrintConfig(&out, cfg); err != nil {
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
