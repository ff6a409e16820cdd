package startup_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/worker-dev/worker"
	"github.com/worker-dev/worker/inbox"
	iinbox "github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// goInboxWorkerEnv makes the test binary a worker that embeds a Go inbox
// handler, "notify" (see runGoInboxWorker): TestMain runs it instead of
// the tests.
const goInboxWorkerEnv = "WORKER_TEST_RUN_GO_INBOX_WORKER"

// runGoInboxWorker is a program that embeds the worker with a Go inbox
// handler, as examples/docs/inbox does: it records each message in
// applied, in the work transaction.
func runGoInboxWorker() int {
	return worker.Run(os.Args[1:], worker.WithInboxHandler("notify", func(ctx context.Context, tx pgx.Tx, m inbox.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO applied (event_id) VALUES ($1)`, m.ID)
		return err
	}))
}

// The active consumer of a single-active-consumer quorum queue is killed
// in the middle of a batch's work, with a sql handler: its transaction
// rolls back with it, the queue hands the batch to the standby consumer
// at once, and that one runs it, in order, within 3 s of the kill,
// without waiting for the lease (30 s) and without an operator.
func TestInboxRabbitMQKilledMidBatchNeedsNoOperator(t *testing.T) {
	t.Parallel()
	pgtest.Need(t, 2*inboxWorkerConns+1+pgtest.PoolConns)
	db := pgtest.New(t)
	ctx := t.Context()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE applied (
		event_id text NOT NULL, aggregate text NOT NULL, seq int NOT NULL, at bigserial)`); err != nil {
		t.Fatal(err)
	}
	url := testkit.RabbitMQURL()
	queue := declareInboxQueue(t, url)
	cfg := writeConfig(t, fmt.Sprintf(`outbox: {enabled: false}
inbox:
  sources:
    - name: shop
      kind: rabbitmq
      rabbitmq: {url: %q, queue: %s}
      handler:
        kind: sql
        sql: INSERT INTO applied (event_id, aggregate, seq) VALUES (@id, @order_key, (@body_json::jsonb->>'seq')::int)
`, url, queue))
	env := func(id string, extra ...string) []string {
		return append(append([]string{"APP_DATABASE_URL=" + db.URL, cfg, "APP_INSTANCE_ID=" + id}, inboxWorker...), extra...)
	}
	consuming := func(p *proc) bool {
		_, body := p.get("/metrics")
		up, _ := sample(body, `inbox_source_up{source="shop"}`)
		return up == 1
	}
	// a consumes first, so the queue makes it the active consumer; b
	// waits as the standby.
	a := startWorker(t, env("a", iinbox.FailpointKillInWork+"=1"))
	a.waitReady(t, 30*time.Second)
	testkit.Eventually(t, 20*time.Second, "a to consume", func() bool { return consuming(a) })
	b := startWorker(t, env("b"))
	b.waitReady(t, 30*time.Second)
	testkit.Eventually(t, 20*time.Second, "b to consume", func() bool { return consuming(b) })

	const messages, keys = 100, 4
	publishOrdered(t, url, queue, messages, keys, nil)
	select {
	case <-a.done:
	case <-time.After(30 * time.Second):
		t.Fatal("a was not killed in its work")
	}
	if !strings.Contains(a.out.String(), "failpoint: killed in a work transaction") {
		t.Fatalf("a exited without its failpoint:\n%s", a.out.String())
	}
	count := func(sql string) int {
		var n int
		if err := db.Pool.QueryRow(ctx, sql).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	defer func() {
		if t.Failed() {
			var states, waits string
			_ = db.Pool.QueryRow(context.Background(), `SELECT coalesce(string_agg(state || ' ' || n, ', '), 'none') FROM (
				SELECT state, count(*) n FROM inbox_message GROUP BY state) s`).Scan(&states)
			_ = db.Pool.QueryRow(context.Background(), `SELECT coalesce(string_agg(application_name || ' ' || state || ' ' || coalesce(wait_event_type, '') || ' ' || left(query, 60), '; '), 'none')
				FROM pg_stat_activity WHERE datname = current_database()`).Scan(&waits)
			_, metrics := b.get("/metrics")
			var received []string
			for line := range strings.SplitSeq(metrics, "\n") {
				if strings.HasPrefix(line, "inbox_received_total") || strings.HasPrefix(line, "inbox_source_up") {
					received = append(received, line)
				}
			}
			t.Logf("inbox rows: %s; sessions: %s; b: %v", states, waits, received)
			ready := func(when string) {
				if conn, err := amqp.Dial(url); err == nil {
					if ch, err := conn.Channel(); err == nil {
						q, err := ch.QueueDeclarePassive(queue, true, false, false, false, amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum, amqp.SingleActiveConsumerArg: true})
						t.Logf("queue %s: %d ready, %d consumers (%v)", when, q.Messages, q.Consumers, err)
					}
					_ = conn.Close()
				}
			}
			ready("with b consuming")
			// What b held unacknowledged goes back to the queue with its
			// connection: ready then tells held from never there.
			_ = b.cmd.Process.Kill()
			<-b.done
			time.Sleep(time.Second)
			ready("after b was killed")
		}
	}()
	testkit.Eventually(t, 20*time.Second, "every message applied", func() bool {
		return count(`SELECT count(DISTINCT event_id) FROM applied`) == messages
	})
	var last time.Time
	if err := db.Pool.QueryRow(ctx, `SELECT max(finished_at) FROM inbox_message`).Scan(&last); err != nil {
		t.Fatal(err)
	}
	stall := last.Sub(a.exitAt)
	parked := count(`SELECT count(*) FROM inbox_message WHERE state <> 'PROCESSED'`)
	doubled := count(`SELECT count(*) - count(DISTINCT event_id) FROM applied`)
	backwards := count(`SELECT count(*) FROM (
		SELECT seq < lag(seq) OVER (PARTITION BY aggregate ORDER BY at) AS back FROM applied) s WHERE back`)
	t.Logf("killed mid-batch; the standby finished the backlog %s after the kill; %d parked, %d doubled, %d out of order",
		stall.Round(time.Millisecond), parked, doubled, backwards)
	if parked != 0 || doubled != 0 || backwards != 0 {
		t.Fatalf("%d messages parked, %d applied twice, %d out of order; want 0", parked, doubled, backwards)
	}
	if stall > 3*time.Second {
		t.Fatalf("the killed batch was done %s after the kill; want within 3s (no wait for the lease)", stall)
	}
}

// A message with a NUL byte in a header, between the ordered messages of
// two keys, is DEAD at once with its reason (counted, and shown by `inbox
// stats` and `inbox dead list`), and the others are applied in order.
func TestInboxRabbitMQNulMessageDeadOthersInOrder(t *testing.T) {
	t.Parallel()
	pgtest.Need(t, inboxWorkerConns+3+pgtest.PoolConns)
	db := pgtest.New(t)
	ctx := t.Context()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE applied (
		event_id text NOT NULL, aggregate text NOT NULL, seq int NOT NULL, at bigserial)`); err != nil {
		t.Fatal(err)
	}
	url := testkit.RabbitMQURL()
	queue := declareInboxQueue(t, url)
	cfg := writeConfig(t, fmt.Sprintf(`outbox: {enabled: false}
inbox:
  sources:
    - name: shop
      kind: rabbitmq
      rabbitmq: {url: %q, queue: %s}
      handler:
        kind: sql
        sql: INSERT INTO applied (event_id, aggregate, seq) VALUES (@id, @order_key, (@body_json::jsonb->>'seq')::int)
`, url, queue))
	// Both keys' messages, with a poisoned one of key 0 in the middle.
	publishOrdered(t, url, queue, 10, 2, map[int]amqp.Table{5: {"x-note": "a\x00b"}})
	p := startWorker(t, append([]string{"APP_DATABASE_URL=" + db.URL, cfg}, inboxWorker...))
	p.waitReady(t, 30*time.Second)
	count := func(sql string) int {
		var n int
		if err := db.Pool.QueryRow(ctx, sql).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	testkit.Eventually(t, 30*time.Second, "the 9 good messages applied and the poisoned one dead", func() bool {
		return count(`SELECT count(*) FROM applied`) == 9 &&
			count(`SELECT count(*) FROM inbox_message WHERE state = 'DEAD' AND last_error LIKE '%NUL byte%'`) == 1
	})
	if n := count(`SELECT count(*) FROM (
		SELECT seq < lag(seq) OVER (PARTITION BY aggregate ORDER BY at) AS back FROM applied) s WHERE back`); n != 0 {
		t.Fatalf("%d messages applied before an earlier one of their key", n)
	}
	_, body := p.get("/metrics")
	if n, _ := sample(body, `inbox_unstorable_total{source="shop"}`); n < 1 {
		t.Errorf("inbox_unstorable_total is %v; want the poisoned message counted", n)
	}
	cli := []string{"APP_DATABASE_URL=" + db.URL}
	if code, out, _ := runCLI(t, cli, "inbox", "stats"); code != 0 || !strings.Contains(out, "DEAD: 1") {
		t.Errorf("inbox stats exited %d:\n%s", code, out)
	}
	if code, out, _ := runCLI(t, cli, "inbox", "dead", "list"); code != 0 || !strings.Contains(out, `x-note`) || !strings.Contains(out, `NUL byte`) {
		t.Errorf("inbox dead list exited %d; want the poisoned message with its reason:\n%s", code, out)
	}
}

// publishOrdered publishes n messages to queue through its exchange, over
// keys order keys, message i of key i%keys carrying seq i/keys, with the
// extra headers given for some.
func publishOrdered(t *testing.T, url, queue string, n, keys int, extra map[int]amqp.Table) {
	t.Helper()
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	// Confirmed, so that every message is in the queue before the test
	// goes on: an unconfirmed publish may still be on its way when the
	// connection closes.
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	confirms := make([]*amqp.DeferredConfirmation, 0, n)
	for i := range n {
		h := amqp.Table{"cloudEvents:id": "m-" + strconv.Itoa(i), "cloudEvents:source": "order", "cloudEvents:subject": "o-" + strconv.Itoa(i%keys)}
		for k, v := range extra[i] {
			h[k] = v
		}
		dc, err := ch.PublishWithDeferredConfirmWithContext(t.Context(), queue, "order.step", false, false, amqp.Publishing{
			Headers: h, Body: []byte(`{"seq":` + strconv.Itoa(i/keys) + `}`), DeliveryMode: amqp.Persistent,
		})
		if err != nil {
			t.Fatal(err)
		}
		confirms = append(confirms, dc)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	for i, dc := range confirms {
		if ok, err := dc.WaitContext(ctx); !ok || err != nil {
			t.Fatalf("message %d was not confirmed by the queue (acked %v): %v", i, ok, err)
		}
	}
}

// A webhook request whose worker is killed in the middle of its work:
// with a sql handler (transactional), the sender's retry with the same
// webhook-id is applied, exactly once; with a Go handler declared to act
// outside the database (effects: external), the message is handed to an
// operator instead, the retry is answered 409 recovery_required, never
// "already received", and `inbox recovery list` shows its one attempt.
func TestInboxWebhookKilledMidWork(t *testing.T) {
	t.Parallel()
	pgtest.Need(t, inboxWorkerConns+3+pgtest.PoolConns)
	db := pgtest.New(t)
	ctx := t.Context()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE applied (event_id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	key := []byte("a-receiver-secret-of-32-bytes!!!")
	orders, notify := freeAddr(t), freeAddr(t)
	cfg := writeConfig(t, fmt.Sprintf(`outbox: {enabled: false}
inbox:
  lease_ttl: 2s
  sources:
    - name: orders
      kind: webhook
      webhook: {addr: %q, secret: whsec_%[3]s}
      handler:
        kind: sql
        sql: INSERT INTO applied (event_id) VALUES (@id)
    - name: notify
      kind: webhook
      effects: external
      webhook: {addr: %[2]q, secret: whsec_%[3]s}
      handler: {kind: notify}
`, orders, notify, base64.StdEncoding.EncodeToString(key)))
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	start := func(failpoint bool) *proc {
		env := append([]string{"APP_DATABASE_URL=" + db.URL, cfg, goInboxWorkerEnv + "=1"}, inboxWorker...)
		if failpoint {
			env = append(env, iinbox.FailpointKillInWork+"=1")
		}
		p := startBinary(t, self, env)
		p.waitReady(t, 30*time.Second)
		return p
	}
	post := func(addr, id string) (int, string) {
		t.Helper()
		body := []byte(`{"n":1}`)
		req := signedWebhookRequest(ctx, "http://"+addr+"/", id, body, key)
		resp, err := (&http.Client{Timeout: 20 * time.Second}).Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	applied := func(id string) int {
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM applied WHERE event_id = $1`, id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	stateOf := func(id string) string {
		var s string
		_ = db.Pool.QueryRow(ctx, `SELECT state FROM inbox_message WHERE msg_id = $1`, id).Scan(&s)
		return s
	}
	killedBy := func(p *proc, addr, id string) {
		t.Helper()
		if code, _ := post(addr, id); code != 0 {
			t.Fatalf("the request got %d; want the worker killed before it answered", code)
		}
		select {
		case <-p.done:
		case <-time.After(20 * time.Second):
			t.Fatal("the worker was not killed in its work")
		}
	}

	killedBy(start(true), orders, "order-1")
	if s := stateOf("order-1"); s != "" {
		t.Fatalf("a transactional message killed mid-work left a row in %s; want none: its claim rolled back", s)
	}
	killedBy(start(true), notify, "note-1")
	p := start(false)
	if code, body := post(orders, "order-1"); code != http.StatusOK || applied("order-1") != 1 || !strings.Contains(body, `"processed"`) {
		t.Fatalf("the retry of the transactional message: %d %s, applied %d times; want 200 processed, once", code, body, applied("order-1"))
	}
	// The external handler's claim committed before its work: once its
	// lease expires, the retry finds it and says an operator has it.
	var code int
	var body string
	testkit.Eventually(t, 20*time.Second, "the retry to be answered recovery_required", func() bool {
		code, body = post(notify, "note-1")
		return code == http.StatusConflict
	})
	if !strings.Contains(body, "recovery_required") || strings.Contains(body, "already received") {
		t.Fatalf("the retry of the cut-off message: %d %s; want 409 saying an operator decides", code, body)
	}
	if s, n := stateOf("note-1"), applied("note-1"); s != iinbox.StateRecoveryRequired || n != 0 {
		t.Fatalf("the cut-off message is %s, applied %d times; want RECOVERY_REQUIRED and not applied", s, n)
	}
	_, out, _ := runCLI(t, []string{"APP_DATABASE_URL=" + db.URL}, "inbox", "recovery", "list", "--output", "json")
	var entries []struct {
		ID       string `json:"msg_id"`
		Attempts int    `json:"attempts"`
	}
	if err := json.Unmarshal([]byte(out), &entries); err != nil || len(entries) != 1 || entries[0].ID != "note-1" || entries[0].Attempts != 1 {
		t.Fatalf("inbox recovery list: %q (%v); want note-1 alone, with the 1 attempt it had", out, err)
	}
	_ = p
}
