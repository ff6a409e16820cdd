package startup_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/worker-dev/worker/internal/outbox/outboxtest"
	"github.com/worker-dev/worker/internal/outbox/sinktest"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// How the broker outage tests run: events arrive every outageInterval over
// outageAggregates aggregates, the broker is away for outageDown, and
// everything must be published within catchUpLimit of its return.
const (
	outageAggregates = 6
	outageInterval   = 100 * time.Millisecond // one event per interval: 10/s
	outageUp         = 1500 * time.Millisecond
	outageAfter      = time.Second
	catchUpLimit     = 10 * time.Second
)

// outageEnv sets how long the broker is away instead of the tests' 4s,
// for measuring longer outages (`WORKER_TEST_SINK_OUTAGE=120s go test -v
// -run Outage ./internal/startup`).
const outageEnv = "WORKER_TEST_SINK_OUTAGE"

func outageDown(t *testing.T) time.Duration {
	v := os.Getenv(outageEnv)
	if v == "" {
		return 4 * time.Second
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		t.Fatalf("%s=%q: want a duration", outageEnv, v)
	}
	return d
}

// poisonType is the aggregate type of the poison aggregate each outage
// test sends beside the others: the broker refuses its events (2 KiB
// payloads, no queue or topic for them), which fail on their own while
// the others publish.
const poisonType = "parcel"

// delivered is one message as the broker holds it.
type delivered struct{ eventID, aggregateID string }

// brokerOutage is one broker sink under test: the worker's settings, how
// to take the broker away and bring it back, and what it holds.
type brokerOutage struct {
	sink    string
	env     []string
	down    func(t *testing.T)
	up      func(t *testing.T)
	read    func(t *testing.T) []delivered
	maxDups int // events whose outcome may be unknown at the cut
	// poisonAttempts is how many attempts a poison event takes to go
	// DEAD: 1 when the broker refuses it for good, else max_attempts.
	poisonAttempts int
}

// runOutage runs the worker against b while events flow, takes the broker
// away for outageDown and brings it back. It then checks: no event DEAD,
// every event published within catchUpLimit of the broker's return, the
// broker holding each event, per aggregate in order with no gap once
// duplicates are dropped on event_id, at most b.maxDups duplicates, and
// outbox_sink_up going 0 during the outage and 1 after it. Meanwhile a
// poison aggregate gets an event before, during and after the outage, and
// each goes DEAD after b.poisonAttempts attempts of its own.
func runOutage(t *testing.T, b brokerOutage) {
	t.Helper()
	db := pgtest.New(t)
	outboxtest.RecordPublishes(t, db.Pool)
	p := startWorker(t, append([]string{
		"APP_DATABASE_URL=" + db.URL,
		"APP_OUTBOX_SINK=" + b.sink,
		// The defaults that dead-lettered events during outages: an outage
		// must not spend attempts.
		"APP_OUTBOX_MAX_ATTEMPTS=3",
		"APP_OUTBOX_BACKOFF_BASE=50ms",
		"APP_OUTBOX_BACKOFF_MAX=500ms",
		"APP_OUTBOX_PROBE_BACKOFF_MAX=200ms",
	}, b.env...))
	p.waitReady(t, 30*time.Second)

	stop := make(chan struct{})
	var produced sync.WaitGroup
	produced.Go(func() { produceEvents(t, db, stop) })

	var poison []string
	addPoison := func() {
		var id string
		if err := db.Pool.QueryRow(t.Context(), `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
			VALUES ($1, 'p-1', 'order.paid', jsonb_build_object('pad', repeat('x', 2048))) RETURNING event_id::text`, poisonType).Scan(&id); err != nil {
			t.Fatal(err)
		}
		poison = append(poison, id)
	}
	addPoison()
	time.Sleep(outageUp) // events flow at a steady rate: the outage must hit traffic
	upLine := fmt.Sprintf("outbox_sink_up{sink=%q} ", b.sink)
	testkit.Eventually(t, 40*time.Second, "the first poison event DEAD before the outage", func() bool {
		return eventStatus(t, db, poison[0]) == "DEAD"
	})
	if v := metricLine(p, upLine); v != "1" {
		t.Errorf("%s%s before the outage, want 1", upLine, v)
	}
	b.down(t)
	testkit.Eventually(t, 20*time.Second, upLine+"0 during the outage", func() bool { return metricLine(p, upLine) == "0" })
	addPoison()
	time.Sleep(outageDown(t)) // the outage lasts while events keep arriving
	b.up(t)
	addPoison()
	back := time.Now()
	var backDB time.Time // the same instant on the database's clock, which stamps test_publish
	if err := db.Pool.QueryRow(t.Context(), `SELECT clock_timestamp()`).Scan(&backDB); err != nil {
		t.Fatal(err)
	}
	time.Sleep(outageAfter) // events keep arriving after the return
	close(stop)
	produced.Wait()

	var total int
	if err := db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM outbox_event WHERE aggregate_type <> $1`, poisonType).Scan(&total); err != nil {
		t.Fatal(err)
	}
	for {
		var published, dead int
		if err := db.Pool.QueryRow(t.Context(), `SELECT count(*) FILTER (WHERE status = 'PUBLISHED'), count(*) FILTER (WHERE status = 'DEAD')
			FROM outbox_event_state WHERE aggregate_type <> $1`, poisonType).Scan(&published, &dead); err != nil {
			t.Fatal(err)
		}
		if dead > 0 {
			t.Fatalf("%d events DEAD after a %s outage of %s", dead, outageDown(t), b.sink)
		}
		if published == total {
			break
		}
		if time.Since(back) > catchUpLimit {
			t.Fatalf("%d of %d events published %s after the broker's return", published, total, catchUpLimit)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The backlog: the events that arrived before the broker's return.
	var waited int
	var backlogDone time.Time
	if err := db.Pool.QueryRow(t.Context(), `SELECT count(*), max(p.at) FROM test_publish p JOIN outbox_event e ON e.id = p.id
		WHERE e.occurred_at < $1 AND p.aggregate_type <> $2`, backDB, poisonType).Scan(&waited, &backlogDone); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: %d events; the %d that arrived before the broker's return were all published %s after it, every event %s after it",
		b.sink, total, waited, backlogDone.Sub(backDB).Round(time.Millisecond), time.Since(back).Round(time.Millisecond))
	checkNoAttemptSpent(t, db, "aggregate_type <> '"+poisonType+"'", total)
	testkit.Eventually(t, 40*time.Second, "every poison event DEAD", func() bool {
		return eventStatus(t, db, poison[1]) == "DEAD" && eventStatus(t, db, poison[2]) == "DEAD"
	})
	for _, id := range poison {
		var attempts int
		if err := db.Pool.QueryRow(t.Context(), `SELECT attempts FROM outbox_event_state WHERE event_id = $1`, id).Scan(&attempts); err != nil {
			t.Fatal(err)
		}
		if attempts != b.poisonAttempts {
			t.Errorf("poison event %s DEAD after %d attempts, want %d", id, attempts, b.poisonAttempts)
		}
	}
	// franz-go can fail a record whose topic it has no metadata for yet
	// as timed out, without naming the missing topic: the poison's own
	// failure then reads as the broker's, and opens the breaker until a
	// probe of another aggregate closes it. Those openings name its topic.
	opens := 0
	for line := range strings.SplitSeq(p.out.String(), "\n") {
		if strings.Contains(line, `"msg":"outbox sink unavailable; claiming stops`) && !strings.Contains(line, " to "+poisonType+":") {
			opens++
		}
	}
	if opens != 1 {
		t.Errorf("%d warnings that the sink is unavailable, want one for the one outage", opens)
	}
	if v := metricLine(p, upLine); v != "1" {
		t.Errorf("%s%s after the outage, want 1", upLine, v)
	}
	checkDelivered(t, db, b.read(t), b.maxDups)
}

// produceEvents inserts one event per outageInterval, round robin over
// outageAggregates aggregates, until stop closes.
func produceEvents(t *testing.T, db *pgtest.DB, stop <-chan struct{}) {
	tick := time.NewTicker(outageInterval)
	defer tick.Stop()
	for n := 0; ; n++ {
		select {
		case <-stop:
			return
		case <-tick.C:
		}
		if _, err := db.Pool.Exec(t.Context(), `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
			VALUES ('order', $1, 'order.paid', jsonb_build_object('n', $2::int))`, fmt.Sprintf("o-%d", n%outageAggregates), n); err != nil {
			t.Errorf("insert: %v", err)
			return
		}
	}
}

// checkDelivered compares what the broker holds with the outbox: per
// aggregate, the first copy of each event in the outbox's order, none
// missing, and at most maxDups copies beyond the first.
func checkDelivered(t *testing.T, db *pgtest.DB, got []delivered, maxDups int) {
	t.Helper()
	rows, err := db.Pool.Query(t.Context(), `SELECT event_id::text, aggregate_id FROM outbox_event WHERE aggregate_type <> $1 ORDER BY id`, poisonType)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]string{}
	for rows.Next() {
		var id, agg string
		if err := rows.Scan(&id, &agg); err != nil {
			t.Fatal(err)
		}
		want[agg] = append(want[agg], id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	first := map[string][]string{}
	dups := 0
	for _, d := range got {
		if seen[d.eventID] {
			dups++
			continue
		}
		seen[d.eventID] = true
		first[d.aggregateID] = append(first[d.aggregateID], d.eventID)
	}
	for agg, ids := range want {
		if strings.Join(first[agg], ",") != strings.Join(ids, ",") {
			t.Errorf("aggregate %s: the broker holds %d events (first copies) %v, the outbox %d %v: a gap or a reorder",
				agg, len(first[agg]), first[agg], len(ids), ids)
		}
	}
	if dups > maxDups {
		t.Errorf("%d duplicates, want at most %d (one per event whose outcome was unknown at the cut)", dups, maxDups)
	}
	t.Logf("%d messages, %d duplicates", len(got), dups)
}

// eventStatus returns the status of the event with event_id id.
func eventStatus(t *testing.T, db *pgtest.DB, id string) string {
	var status string
	if err := db.Pool.QueryRow(t.Context(), `SELECT status FROM outbox_event_state WHERE event_id = $1`, id).Scan(&status); err != nil {
		t.Fatal(err)
	}
	return status
}

// failedAttempts is, for a test_publish row, how many attempts the event
// spent before the publish that succeeded. A publish that completed in its
// batch deletes the row with the attempts of the failures before it; one
// that completed after its batch (detached) was counted once when it was
// marked IN_FLIGHT, and is deleted IN_FLIGHT.
const failedAttempts = `attempts - (status = 'IN_FLIGHT')::int`

// checkNoAttemptSpent checks that each of the want events matching where
// (SQL on test_publish) was published once, with no failed attempt before:
// a sink outage must cost no attempt.
func checkNoAttemptSpent(t *testing.T, db *pgtest.DB, where string, want int) {
	t.Helper()
	var published, distinct, spent int
	if err := db.Pool.QueryRow(t.Context(), `SELECT count(*), count(DISTINCT id), count(*) FILTER (WHERE `+failedAttempts+` <> 0)
		FROM test_publish WHERE `+where).Scan(&published, &distinct, &spent); err != nil {
		t.Fatal(err)
	}
	if published != want || distinct != want {
		t.Errorf("%d publishes recorded for %d events, want %d each once", published, distinct, want)
	}
	if spent > 0 {
		t.Errorf("%d events spent attempts on the outage, want their attempts untouched", spent)
		rows, _ := db.Pool.Query(t.Context(), `SELECT id, status, attempts, coalesce(last_error, '')
			FROM test_publish WHERE `+failedAttempts+` <> 0 AND `+where+` ORDER BY id`)
		for rows.Next() {
			var id int64
			var status, lastErr string
			var attempts int
			_ = rows.Scan(&id, &status, &attempts, &lastErr)
			t.Logf("event %d: published %s after %d attempts, last error %q", id, status, attempts, lastErr)
		}
		rows.Close()
	}
}

// metricLine returns the value of the /metrics line starting with prefix
// ("" when there is none).
func metricLine(p *proc, prefix string) string {
	_, body := p.get("/metrics")
	for line := range strings.SplitSeq(body, "\n") {
		if v, ok := strings.CutPrefix(line, prefix); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// A nats-server stopped and started again on the same store directory
// while events flow: none is lost, reordered or dead-lettered, and the
// stream deduplicates what the relay had to send again. The stream takes
// messages of at most 1 KiB: it refuses the poison's for good.
func TestNATSOutage(t *testing.T) {
	t.Parallel()
	store := t.TempDir()
	srv := startNATS(t, server.RANDOM_PORT, store)
	port := srv.Addr().(*net.TCPAddr).Port
	if _, err := jetStreamClient(t, srv.ClientURL()).CreateStream(t.Context(), jetstream.StreamConfig{
		Name: "OUTBOX", Subjects: []string{"outbox.*.*"}, Storage: jetstream.FileStorage, Duplicates: 2 * time.Minute,
		MaxMsgSize: 1024,
	}); err != nil {
		t.Fatal(err)
	}
	runOutage(t, brokerOutage{
		sink: "nats",
		env: []string{
			"APP_OUTBOX_NATS_URL=" + srv.ClientURL(),
			"APP_OUTBOX_NATS_USER=relay",
			"APP_OUTBOX_NATS_PASSWORD=" + natsPassword,
			"APP_OUTBOX_NATS_PUBLISH_TIMEOUT=1s",
		},
		down:           func(*testing.T) { srv.Shutdown(); srv.WaitForShutdown() },
		up:             func(t *testing.T) { srv = startNATS(t, port, store) },
		read:           func(t *testing.T) []delivered { return readStream(t, srv.ClientURL(), "OUTBOX") },
		poisonAttempts: 1,
	})
}

// jetStreamClient connects to url as the relay's user, until the test ends.
func jetStreamClient(t *testing.T, url string) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(url, nats.UserInfo("relay", natsPassword))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// readStream returns every message of the stream, in stream order.
func readStream(t *testing.T, url, stream string) []delivered {
	t.Helper()
	js := jetStreamClient(t, url)
	st, err := js.Stream(t.Context(), stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	cons, err := js.OrderedConsumer(t.Context(), stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var out []delivered
	for uint64(len(out)) < info.State.Msgs {
		batch, err := cons.Fetch(int(info.State.Msgs-uint64(len(out))), jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		n := len(out)
		for m := range batch.Messages() {
			out = append(out, delivered{eventID: m.Headers().Get("Nats-Msg-Id"), aggregateID: m.Headers().Get("ce-subject")})
		}
		if len(out) == n {
			t.Fatalf("read %d of the stream's %d messages, then nothing more", n, info.State.Msgs)
		}
	}
	return out
}

// RabbitMQ reached through a proxy that is cut for a few seconds while
// events flow: none is lost, reordered or dead-lettered; an event is on
// the queue twice only if its confirm was lost with the connection. No
// queue is bound for the poison's routing key: the broker returns its
// events unroutable, DEAD at once.
func TestRabbitMQOutage(t *testing.T) {
	t.Parallel()
	testkit.SkipWithoutRabbitMQ(t)
	u := testkit.ParseRabbitMQURL(t)
	exchange, queue := declareOutageQueue(t, u.String())
	proxy := sinktest.NewProxy(t, u.Host)
	u.Host = proxy.Addr()
	runOutage(t, brokerOutage{
		sink: "rabbitmq",
		env: []string{
			"APP_OUTBOX_RABBITMQ_URL=" + u.String(),
			"APP_OUTBOX_RABBITMQ_EXCHANGE=" + exchange,
			"APP_OUTBOX_RABBITMQ_PUBLISH_TIMEOUT=1s",
		},
		down:           func(*testing.T) { proxy.Cut() },
		up:             func(t *testing.T) { proxy.Restore(t) },
		read:           func(t *testing.T) []delivered { return readQueue(t, queue) },
		maxDups:        outageAggregates, // one event in flight per aggregate at the cut
		poisonAttempts: 1,
	})
}

// declareOutageQueue declares a topic exchange and a queue bound to the
// order aggregates' routing keys, deleted when the test ends.
func declareOutageQueue(t *testing.T, url string) (exchange, queue string) {
	t.Helper()
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatalf("RabbitMQ is not reachable (%s names another, %s=1 skips): %v", testkit.RabbitMQURLEnv, testkit.RabbitMQSkipEnv, err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	name := "outage-" + uuid.NewString()[:8]
	if err := ch.ExchangeDeclare(name, "topic", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclare(name, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(name, "order.#", name, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if conn, err := amqp.Dial(testkit.RabbitMQURL()); err == nil {
			ch, _ := conn.Channel()
			_, _ = ch.QueueDelete(name, false, false, false)
			_ = ch.ExchangeDelete(name, false, false)
			_ = conn.Close()
		}
	})
	return name, name
}

// readQueue takes every message off the queue, in queue order.
func readQueue(t *testing.T, queue string) []delivered {
	t.Helper()
	conn, err := amqp.Dial(testkit.RabbitMQURL())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	var out []delivered
	for {
		d, ok, err := ch.Get(queue, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			return out
		}
		out = append(out, delivered{eventID: d.MessageId, aggregateID: fmt.Sprint(d.Headers["cloudEvents:subject"])})
	}
}

// Every kfake broker stopped and started again on the same ports and data
// while events flow: none is lost, reordered or dead-lettered. The poison's
// topic does not exist: each of its events fails max_attempts times.
func TestKafkaOutage(t *testing.T) {
	t.Parallel()
	data := t.TempDir()
	start := func(t *testing.T, ports ...int) *kfake.Cluster {
		opts := []kfake.Opt{kfake.NumBrokers(3), kfake.DataDir(data), kfake.SeedTopics(4, "order")}
		if len(ports) > 0 {
			opts = append(opts, kfake.Ports(ports...))
		}
		c, err := kfake.NewCluster(opts...)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	cluster := start(t)
	t.Cleanup(func() { cluster.Close() })
	addrs := cluster.ListenAddrs()
	var ports []int
	for _, a := range addrs {
		_, port, _ := net.SplitHostPort(a)
		n, err := strconv.Atoi(port)
		if err != nil {
			t.Fatal(err)
		}
		ports = append(ports, n)
	}
	runOutage(t, brokerOutage{
		sink: "kafka",
		env: []string{
			"APP_OUTBOX_KAFKA_BROKERS=" + strings.Join(addrs, ","),
			"APP_OUTBOX_KAFKA_PUBLISH_TIMEOUT=1s",
		},
		down:           func(*testing.T) { cluster.Close() },
		up:             func(t *testing.T) { cluster = start(t, ports...) },
		read:           func(t *testing.T) []delivered { return readTopic(t, addrs, "order") },
		maxDups:        outageAggregates, // one event in flight per aggregate at the cut
		poisonAttempts: 3,
	})
}

// readTopic returns every record of the topic, each partition in order.
func readTopic(t *testing.T, brokers []string, topic string) []delivered {
	t.Helper()
	c, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var out []delivered
	for empty := 0; ; {
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
		fetches := c.PollFetches(ctx)
		cancel()
		n := 0
		fetches.EachRecord(func(r *kgo.Record) {
			n++
			d := delivered{}
			for _, h := range r.Headers {
				switch h.Key {
				case "ce_id":
					d.eventID = string(h.Value)
				case "ce_subject":
					d.aggregateID = string(h.Value)
				}
			}
			out = append(out, d)
		})
		switch {
		case n > 0:
		case len(out) > 0:
			return out // a poll that brings nothing after records: the topic is read
		default:
			if empty++; empty == 10 {
				t.Fatalf("no record in topic %s after %d polls", topic, empty)
			}
		}
	}
}
