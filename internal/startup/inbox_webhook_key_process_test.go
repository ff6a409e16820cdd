package startup_test

import (
	"bytes"
	"encoding/base64"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
)

// A webhook source configured as configs/worker.yaml's example
// (key: field:event_id), through the worker: the same event sent under
// two webhook-ids is applied once, the configured key winning over
// webhook-id; a request without the field is refused with 400 and
// stores nothing; a wrong secret is counted as bad_signature.
func TestInboxWebhookConfiguredKey(t *testing.T) {
	t.Parallel()
	pgtest.Need(t, inboxWorkerConns+1+pgtest.PoolConns)
	db := pgtest.New(t)
	ctx := t.Context()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE partner_event (id text NOT NULL, body jsonb)`); err != nil {
		t.Fatal(err)
	}
	key := []byte("a-receiver-secret-of-32-bytes!!!")
	addr := freeAddr(t)
	cfg := writeConfig(t, fmt.Sprintf(`outbox: {enabled: false}
inbox:
  sources:
    - name: partner-hooks
      kind: webhook
      key: field:event_id
      handler: {kind: sql, sql: "INSERT INTO partner_event (id, body) VALUES (@id, @body_json)"}
      webhook: {addr: %q, secret: whsec_%s}
`, addr, base64.StdEncoding.EncodeToString(key)))
	p := startWorker(t, append([]string{"APP_DATABASE_URL=" + db.URL, cfg}, inboxWorker...))
	p.waitReady(t, 30*time.Second)

	post := func(webhookID string, body []byte, secret []byte) int {
		t.Helper()
		req := signedWebhookRequest(ctx, "http://"+addr+"/", webhookID, body, secret)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	event := []byte(`{"event_id": "evt-42", "amount": 7}`)
	if code := post("msg_1", event, key); code != http.StatusOK {
		t.Fatalf("the event: %d, want 200", code)
	}
	if code := post("msg_2", event, key); code != http.StatusOK {
		t.Fatalf("the event again, under another webhook-id: %d, want 200 (a duplicate)", code)
	}
	if code := post("msg_3", []byte(`{"amount": 7}`), key); code != http.StatusBadRequest {
		t.Errorf("a request without event_id: %d, want 400", code)
	}
	if code := post("msg_4", event, []byte("not the receiver's secret")); code != http.StatusUnauthorized {
		t.Errorf("a wrong secret: %d, want 401", code)
	}
	var applied, rows int
	if err := db.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM partner_event WHERE id = 'evt-42'), (SELECT count(*) FROM inbox_message)`).Scan(&applied, &rows); err != nil {
		t.Fatal(err)
	}
	if applied != 1 || rows != 1 {
		t.Errorf("the event applied %d times, %d inbox rows; want once, one row", applied, rows)
	}
	_, metrics := p.get("/metrics")
	for _, want := range []string{
		`inbox_webhook_refused_total{reason="bad_request",source="partner-hooks"} 1`,
		`inbox_webhook_refused_total{reason="bad_signature",source="partner-hooks"} 1`,
		`inbox_received_total{outcome="duplicate",source="partner-hooks"} 1`,
	} {
		if !bytes.Contains([]byte(metrics), []byte(want)) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}
