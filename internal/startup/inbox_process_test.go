package startup_test

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// The inbox's promise, end to end through real binaries: a producer's
// transactions write events, a publishing worker relays them to a broker
// (and is killed now and then, so it publishes some twice), two consuming
// workers' inboxes apply each event's work with a sql handler, and each
// consumer is killed again and again right after a work commit, before its
// acknowledgement, so the broker redelivers what was done. Every event's
// work must be applied exactly once; with Kafka, whose partitions keep
// each aggregate's order across consumers, in order too.
func TestInboxExactlyOnceNATS(t *testing.T) {
	t.Parallel()
	store := t.TempDir()
	srv := runNATS(t, &server.Options{Port: server.RANDOM_PORT, StoreDir: store})
	runInboxExactlyOnce(t, inboxRun{
		publisher: []string{"APP_OUTBOX_SINK=nats", "APP_OUTBOX_NATS_URL=" + srv.ClientURL(), "APP_OUTBOX_NATS_CREATE_STREAM=true"},
		source: fmt.Sprintf(`kind: nats
      nats: {url: %q, stream: OUTBOX, consumer: shop, create_consumer: true, ack_wait: 5s}`, srv.ClientURL()),
	})
}

// Kafka: a consumer killed without leaving keeps its partitions for the
// group's session timeout, the least Kafka allows here.
func TestInboxExactlyOnceKafka(t *testing.T) {
	t.Parallel()
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, "order"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	brokers := strings.Join(cluster.ListenAddrs(), ",")
	runInboxExactlyOnce(t, inboxRun{
		publisher: []string{"APP_OUTBOX_SINK=kafka", "APP_OUTBOX_KAFKA_BROKERS=" + brokers},
		source: fmt.Sprintf(`kind: kafka
      kafka: {brokers: %q, topics: order, group: shop, session_timeout: 6s}`, brokers),
		ordered: true,
	})
}

// RabbitMQ: a quorum queue with single active consumer keeps each
// aggregate's order while two consumers take turns.
func TestInboxExactlyOnceRabbitMQ(t *testing.T) {
	t.Parallel()
	url := testkit.RabbitMQURL()
	exchange := declareInboxQueue(t, url)
	runInboxExactlyOnce(t, inboxRun{
		publisher: []string{"APP_OUTBOX_SINK=rabbitmq", "APP_OUTBOX_RABBITMQ_URL=" + url, "APP_OUTBOX_RABBITMQ_EXCHANGE=" + exchange},
		source: fmt.Sprintf(`kind: rabbitmq
      rabbitmq: {url: %q, queue: %s}`, url, exchange),
		ordered: true,
	})
}

// declareInboxQueue declares a topic exchange and a quorum queue of the
// same name with single active consumer, bound to the order aggregates'
// routing keys, deleted when the test ends.
func declareInboxQueue(t *testing.T, url string) string {
	t.Helper()
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatalf("RabbitMQ is not reachable: %v", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	name := "inbox-" + uuid.NewString()[:8]
	if err := ch.ExchangeDeclare(name, "topic", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	args := amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum, amqp.SingleActiveConsumerArg: true}
	if _, err := ch.QueueDeclare(name, true, false, false, false, args); err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(name, "order.#", name, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if conn, err := amqp.Dial(url); err == nil {
			ch, _ := conn.Channel()
			_, _ = ch.QueueDelete(name, false, false, false)
			_ = ch.ExchangeDelete(name, false, false)
			_ = conn.Close()
		}
	})
	return name
}

type inboxRun struct {
	publisher []string // the publishing worker's sink settings
	source    string   // the consumers' inbox source entry's kind and section, YAML
	ordered   bool     // the source keeps each aggregate's order
}

// inboxWorker is the smallest worker these tests run: a pool of 3, no
// tasks. With the readiness probe and the relay's listener, it holds
// inboxWorkerConns connections at most.
var inboxWorker = []string{"APP_DATABASE_MAX_CONNS=3", "APP_TASKS_ENABLED=false"}

const inboxWorkerConns = 5

const (
	inboxEvents     = 10000
	inboxAggregates = 200
	inboxKills      = 6 // of each consumer, between commit and ack
)

func runInboxExactlyOnce(t *testing.T, run inboxRun) {
	// One database serves the producer and the consumers, as it would a
	// service that consumes its own events: the suite's share of the
	// server fits three workers and one database.
	pgtest.Need(t, 3*inboxWorkerConns+1+pgtest.PoolConns)
	db := pgtest.New(t)
	producerDB, consumerDB := db, db
	ctx := t.Context()
	if _, err := consumerDB.Pool.Exec(ctx, `CREATE TABLE applied (
		event_id text NOT NULL, aggregate text NOT NULL, seq int NOT NULL, at bigserial)`); err != nil {
		t.Fatal(err)
	}
	cfg := writeConfig(t, `outbox: {enabled: false}
inbox:
  lease_ttl: 5s
  backoff_base: 10ms
  backoff_max: 100ms
  sources:
    - name: shop
      `+run.source+`
      handler:
        kind: sql
        sql: INSERT INTO applied (event_id, aggregate, seq) VALUES (@id, @order_key, (@body_json::jsonb->>'seq')::int)
`)
	// The publisher, killed a few times mid-run: what it published and
	// had not marked is published again.
	pubEnv := append(append([]string{"APP_DATABASE_URL=" + producerDB.URL}, inboxWorker...), run.publisher...)
	publisher := startWorker(t, pubEnv)
	publisher.waitReady(t, 30*time.Second)
	// The consumers, each restarted after its failpoint kills it.
	var mu sync.Mutex
	kills, unacked := 0, 0
	consumers := make([]*proc, 2)
	startConsumer := func(i, killAfter int) *proc {
		env := append([]string{"APP_DATABASE_URL=" + consumerDB.URL, cfg, "APP_INSTANCE_ID=consumer-" + strconv.Itoa(i)}, inboxWorker...)
		if killAfter > 0 {
			env = append(env, inbox.FailpointKillAfterCommit+"="+strconv.Itoa(killAfter))
		}
		return startWorker(t, env)
	}
	for i := range consumers {
		consumers[i] = startConsumer(i, 5+i*3)
		consumers[i].waitReady(t, 30*time.Second)
		go func() {
			for k := 1; ; k++ {
				p := func() *proc { mu.Lock(); defer mu.Unlock(); return consumers[i] }()
				select {
				case <-p.done:
				case <-ctx.Done():
					return
				}
				if ctx.Err() != nil {
					return
				}
				next := 0
				if k < inboxKills {
					next = 10 + 7*k + i
				}
				mu.Lock()
				kills++
				unacked += killedUnacked(p.out.String())
				consumers[i] = startConsumer(i, next)
				mu.Unlock()
				if next == 0 {
					return
				}
			}
		}()
	}

	prod := startProducerOf(t, producerDB, inboxEvents, inboxAggregates)
	for range 2 {
		testkit.Eventually(t, 60*time.Second, "the publisher to make progress", func() bool {
			var n int
			_ = producerDB.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event_state WHERE status = 'PUBLISHED'`).Scan(&n)
			return n > 0
		})
		_ = publisher.cmd.Process.Kill()
		<-publisher.done
		publisher = startWorker(t, pubEnv)
	}
	<-prod.done
	if prod.err != nil {
		t.Fatal(prod.err)
	}

	count := func(sql string) int {
		var n int
		if err := consumerDB.Pool.QueryRow(ctx, sql).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	testkit.Eventually(t, 4*time.Minute, "every event's work to be applied", func() bool {
		return count(`SELECT count(DISTINCT event_id) FROM applied`) == inboxEvents
	})
	// Let redeliveries in flight arrive before counting doubles.
	testkit.Eventually(t, 30*time.Second, "no claim in progress", func() bool {
		return count(`SELECT count(*) FROM inbox_message WHERE finished_at IS NULL`) == 0
	})
	total, distinct := count(`SELECT count(*) FROM applied`), count(`SELECT count(DISTINCT event_id) FROM applied`)
	doubled := total - distinct
	var published int
	_ = producerDB.Pool.QueryRow(ctx, `SELECT count(*) FROM outbox_event`).Scan(&published)
	mu.Lock()
	k, left := kills, unacked
	mu.Unlock()
	recovery := count(`SELECT count(*) FROM inbox_message WHERE state = 'RECOVERY_REQUIRED'`)
	t.Logf("%d events (%d rows in the publisher's outbox), %d applied once, %d doubled, %d missing; %d consumer kills between commit and ack left %d processed deliveries for the broker to redeliver; %d recovery_required",
		inboxEvents, published, distinct, doubled, inboxEvents-distinct, k, left, recovery)
	if doubled != 0 || distinct != inboxEvents {
		t.Fatalf("%d events' work applied more than once, %d missing", doubled, inboxEvents-distinct)
	}
	if k < 2 || left == 0 {
		t.Fatalf("the consumers were killed %d times between commit and ack, leaving %d deliveries unacknowledged; the test proves nothing without it", k, left)
	}
	if run.ordered {
		outOfOrder := count(`SELECT count(*) FROM (
			SELECT seq < lag(seq) OVER (PARTITION BY aggregate ORDER BY at) AS back FROM applied) s WHERE back`)
		if outOfOrder != 0 {
			t.Fatalf("%d events applied before an earlier event of their aggregate", outOfOrder)
		}
	}
}

// killedUnacked reads what a worker killed by the failpoint left
// unacknowledged, from its output.
func killedUnacked(out string) int {
	_, rest, ok := strings.Cut(out, "failpoint: killed after a commit, ")
	if !ok {
		return 0
	}
	n, _ := strconv.Atoi(strings.Fields(rest)[0])
	return n
}

// producerOf inserts total events over aggregates, each with its sequence
// in its aggregate, in transactions of 50.
type producerOf struct {
	err  error
	done chan struct{}
}

func startProducerOf(t *testing.T, db *pgtest.DB, total, aggregates int) *producerOf {
	p := &producerOf{done: make(chan struct{})}
	go func() {
		defer close(p.done)
		for g := 0; g < total; g += 50 {
			_, err := db.Pool.Exec(t.Context(), `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
				SELECT 'order', 'o-' || (i % $2), 'order.step', jsonb_build_object('seq', i / $2)
				FROM generate_series($1::int, $1::int + 49) i`, g, aggregates)
			if err != nil {
				p.err = err
				return
			}
		}
	}()
	return p
}

// A consumer stopped (SIGSTOP) in the middle of a sql handler's work, past
// its lease: its claim, work and PROCESSED are one transaction, which the
// server ends (idle in transaction past a third of the lease), so the
// other consumer, given the redelivery, runs the message once, and the
// stopped one, resumed, commits nothing. No operator is needed. (A
// handler with external effects goes to RECOVERY_REQUIRED instead:
// TestInboxWebhookKilledMidWork.)
func TestInboxStoppedConsumerWorkRunsOnceElsewhere(t *testing.T) {
	t.Parallel()
	srv := runNATS(t, &server.Options{Port: server.RANDOM_PORT, StoreDir: t.TempDir()})
	pgtest.Need(t, 2*inboxWorkerConns+1+pgtest.PoolConns)
	db := pgtest.New(t)
	ctx := t.Context()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE applied (event_id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "IN", Subjects: []string{"in.>"}}); err != nil {
		t.Fatal(err)
	}
	cfg := writeConfig(t, fmt.Sprintf(`outbox: {enabled: false}
inbox:
  lease_ttl: 6s
  sources:
    - name: shop
      kind: nats
      nats: {url: %q, stream: IN, consumer: shop, create_consumer: true, ack_wait: 2s}
      handler:
        kind: sql
        sql: >-
          WITH s AS (SELECT pg_sleep(3))
          INSERT INTO applied (event_id) SELECT @id FROM s
`, srv.ClientURL()))
	env := func(id string) []string {
		return append([]string{"APP_DATABASE_URL=" + db.URL, cfg, "APP_INSTANCE_ID=" + id}, inboxWorker...)
	}
	a := startWorker(t, env("a"))
	a.waitReady(t, 30*time.Second)
	msg := nats.NewMsg("in.order")
	msg.Header.Set("ce-id", "m-1")
	msg.Header.Set("ce-source", "shop")
	msg.Data = []byte(`{}`)
	if _, err := js.PublishMsg(ctx, msg); err != nil {
		t.Fatal(err)
	}
	count := func(sql string) int {
		var n int
		if err := db.Pool.QueryRow(ctx, sql).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	testkit.Eventually(t, 20*time.Second, "a's work to start", func() bool {
		return count(`SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'WITH s AS (SELECT pg_sleep%'`) == 1
	})
	if err := a.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	b := startWorker(t, env("b"))
	b.waitReady(t, 30*time.Second)
	testkit.Eventually(t, 30*time.Second, "b to run the message", func() bool {
		return count(`SELECT count(*) FROM inbox_message WHERE msg_id = 'm-1' AND state = 'PROCESSED'`) == 1
	})
	if err := a.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	// a resumes and its late work ends: the server ended its session,
	// idle in transaction past a third of the lease (a database error to
	// a, or past its share of the lease a timeout), and its next claim
	// finds the message done (a duplicate).
	testkit.Eventually(t, 20*time.Second, "a's late work to end", func() bool {
		_, body := a.get("/metrics")
		failed, _ := sample(body, `inbox_transaction_errors_total{source="shop"}`)
		duplicate, _ := sample(body, `inbox_received_total{outcome="duplicate",source="shop"}`)
		return failed+duplicate > 0
	})
	testkit.Eventually(t, 30*time.Second, "every delivery settled", func() bool {
		c, err := js.Consumer(ctx, "IN", "shop")
		if err != nil {
			t.Fatal(err)
		}
		info, err := c.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return info.NumAckPending == 0 && info.NumPending == 0
	})
	if n := count(`SELECT count(*) FROM applied`); n != 1 {
		t.Fatalf("the message's work was applied %d times; want once", n)
	}
	if st := count(`SELECT count(*) FROM inbox_message WHERE msg_id = 'm-1' AND state = 'PROCESSED'`); st != 1 {
		t.Fatal("the message is not PROCESSED: it needs an operator, or the late commit changed it")
	}
}

// The webhook receiver, through the worker: a signed message is processed
// and answered 200 after its commit, its duplicate does no second piece of
// work, and a bad signature (401) or a 10 MB body (413) does none.
func TestInboxWebhookReceiver(t *testing.T) {
	t.Parallel()
	pgtest.Need(t, inboxWorkerConns+1+pgtest.PoolConns)
	db := pgtest.New(t)
	ctx := t.Context()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE applied (event_id text NOT NULL, n int)`); err != nil {
		t.Fatal(err)
	}
	key := []byte("a-receiver-secret-of-32-bytes!!!")
	addr := freeAddr(t)
	cfg := writeConfig(t, fmt.Sprintf(`outbox: {enabled: false}
inbox:
  sources:
    - name: partner
      kind: webhook
      webhook: {addr: %q, path: /hooks, secret: whsec_%s, max_body: 1048576}
      handler:
        kind: sql
        sql: INSERT INTO applied (event_id, n) VALUES (@id, (@body_json::jsonb->>'n')::int)
`, addr, base64.StdEncoding.EncodeToString(key)))
	p := startWorker(t, append([]string{"APP_DATABASE_URL=" + db.URL, cfg}, inboxWorker...))
	p.waitReady(t, 30*time.Second)

	post := func(id string, body []byte, sign []byte) int {
		t.Helper()
		req := signedWebhookRequest(ctx, "http://"+addr+"/hooks", id, body, sign)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0 // a 10 MB body may be cut off before it is sent whole
		}
		defer resp.Body.Close()
		return resp.StatusCode
	}
	applied := func(id string) int {
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM applied WHERE event_id = $1`, id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if code := post("msg-1", []byte(`{"n":1}`), key); code != http.StatusOK || applied("msg-1") != 1 {
		t.Fatalf("a signed message: %d, applied %d times; want 200 after its work committed once", code, applied("msg-1"))
	}
	if code := post("msg-1", []byte(`{"n":1}`), key); code != http.StatusOK || applied("msg-1") != 1 {
		t.Fatalf("its duplicate: %d, applied %d times; want 200 and no second piece of work", code, applied("msg-1"))
	}
	if code := post("msg-2", []byte(`{"n":2}`), []byte("another secret of thirty-two b!!")); code != http.StatusUnauthorized || applied("msg-2") != 0 {
		t.Fatalf("a bad signature: %d, applied %d times; want 401 and no work", code, applied("msg-2"))
	}
	big := append(append([]byte(`{"n":3,"pad":"`), bytes.Repeat([]byte("x"), 10<<20)...), '"', '}')
	if code := post("msg-3", big, key); (code != http.StatusRequestEntityTooLarge && code != 0) || applied("msg-3") != 0 {
		t.Fatalf("a 10 MB body: %d, applied %d times; want 413 and no work", code, applied("msg-3"))
	}
	var rows int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM inbox_message`).Scan(&rows); err != nil || rows != 1 {
		t.Fatalf("%d inbox rows, want only msg-1's (%v)", rows, err)
	}
}

// signedWebhookRequest is a POST of body to url signed as Standard
// Webhooks asks: an HMAC-SHA256 of "id.timestamp.body" with secret.
func signedWebhookRequest(ctx context.Context, url, id string, body, secret []byte) *http.Request {
	ts := strconv.FormatInt(time.Now().Unix(), 10)
	mac := hmac.New(sha256.New, secret)
	mac.Write([]byte(id + "." + ts + "."))
	mac.Write(body)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	req.Header.Set("webhook-id", id)
	req.Header.Set("webhook-timestamp", ts)
	req.Header.Set("webhook-signature", "v1,"+base64.StdEncoding.EncodeToString(mac.Sum(nil)))
	return req
}
