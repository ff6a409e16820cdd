package startup_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// NATS consumers killed (SIGKILL, right after a work commit and before its
// acks) while two of them drain a backlog, through the worker, with the
// default ack_wait. In ordered mode (max_ack_pending 1) the killed
// replica held the stream's one message out: the stream stalls until the
// server redelivers it, ack_wait later, and no longer. In unordered mode
// the other replica works on meanwhile. Either way every event is applied
// once, and in ordered mode in the stream's order. The stall after each
// kill is logged.
func TestInboxNATSKilledConsumers(t *testing.T) {
	t.Parallel()
	for _, mode := range []inboxKillRun{
		// A commit is one message in ordered mode, a fetch of up to 100
		// otherwise; the counts restart with each process.
		{name: "ordered", ordered: true, events: 600, maxStall: natsMaxStall, killAt: func(k, i int) int { return 40 + 20*k + 15*i }},
		{name: "unordered", events: 5000, maxStall: natsMaxStall, killAt: func(k, i int) int { return 2 + 2*k + i }},
	} {
		// One after the other: each runs two workers, and the machine is
		// shared.
		t.Run(mode.name, func(t *testing.T) {
			srv := runNATS(t, &server.Options{Port: server.RANDOM_PORT, StoreDir: t.TempDir()})
			publishBacklog(t, srv.ClientURL(), mode.events)
			maxAckPending := 1000
			if mode.ordered {
				maxAckPending = 1
			}
			mode.source = fmt.Sprintf(`kind: nats
      nats: {url: %q, stream: SHOP, consumer: shop, create_consumer: true, max_ack_pending: %d}`, srv.ClientURL(), maxAckPending)
			runInboxKills(t, mode)
		})
	}
}

// Kafka consumers killed the same way: the killed replica's partitions
// wait for the group's session to end (session_timeout 6s), then for the
// rebalance, which waits at most inbox.lease_ttl (10s here) for the live
// replica to rejoin. Every event is applied once and in its aggregate's
// order (each aggregate in one partition, one member per partition), and no
// claim deadlocks.
func TestInboxKafkaKilledConsumers(t *testing.T) {
	t.Parallel()
	const events = 3000
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(6, "shop"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	brokers := strings.Join(cluster.ListenAddrs(), ",")
	produceBacklog(t, brokers, events)
	runInboxKills(t, inboxKillRun{
		name: "kafka", ordered: true, events: events,
		source: fmt.Sprintf(`kind: kafka
      kafka: {brokers: %q, topics: shop, group: shop, session_timeout: 6s}`, brokers),
		leaseTTL: 10 * time.Second,
		// The session, the rebalance's wait for the live replica, a
		// restart, and slack for a loaded machine.
		maxStall: 6*time.Second + 10*time.Second + 9*time.Second,
		// A commit is a lane's share of a poll.
		killAt: func(k, i int) int { return 3 + 3*k + i },
	})
}

// inboxKillRun is one run of runInboxKills: two replicas of source, each
// killed inboxKillsEach times after a work commit.
type inboxKillRun struct {
	name     string
	source   string // the inbox source's YAML after "- name: shop", indented
	ordered  bool   // the source keeps each aggregate's order
	events   int
	leaseTTL time.Duration // inbox.lease_ttl; 0 keeps the default
	maxStall time.Duration // the longest a kill may stop the source
	// killAt is the work commit after which consumer i kills itself the
	// k-th time.
	killAt func(k, i int) int
}

const (
	inboxKillAggregates = 20
	inboxKillsEach      = 3
	// natsMaxStall is the longest a kill may stop a NATS stream: ack_wait's
	// default (5s), a restart, and slack for a loaded machine.
	natsMaxStall = 10 * time.Second
)

// runInboxKills runs two replicas of run.source in front of a sql handler
// until every event is applied, each killing itself after some work
// commits and started again, and checks what the kills cost: no event
// applied twice, none parked for an operator, the order kept, no deadlock,
// and the stall after each kill within run.maxStall.
func runInboxKills(t *testing.T, run inboxKillRun) {
	pgtest.Need(t, 2*inboxWorkerConns+pgtest.PoolConns)
	db := pgtest.New(t)
	ctx := t.Context()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE applied (
		n bigserial, event_id text NOT NULL, aggregate text NOT NULL, seq int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`); err != nil {
		t.Fatal(err)
	}
	leaseTTL := ""
	if run.leaseTTL > 0 {
		leaseTTL = fmt.Sprintf("\n  lease_ttl: %s", run.leaseTTL)
	}
	cfg := writeConfig(t, fmt.Sprintf(`outbox: {enabled: false}
inbox:
  backoff_base: 10ms
  backoff_max: 100ms%s
  sources:
    - name: shop
      %s
      handler:
        kind: sql
        sql: INSERT INTO applied (event_id, aggregate, seq) VALUES (@id, @order_key, (@body_json::jsonb->>'seq')::int)
`, leaseTTL, run.source))
	deadlocksBefore := deadlocks(t, db)
	start := func(i, killAfter int) *proc {
		env := append([]string{"APP_DATABASE_URL=" + db.URL, cfg, "APP_INSTANCE_ID=shop-" + strconv.Itoa(i)}, inboxWorker...)
		if killAfter > 0 {
			env = append(env, inbox.FailpointKillAfterCommit+"="+strconv.Itoa(killAfter))
		}
		return startWorker(t, env)
	}
	var mu sync.Mutex
	var kills []time.Time
	var wg sync.WaitGroup
	done := make(chan struct{}) // every event applied: start no more
	for i := range 2 {
		p := start(i, run.killAt(0, i))
		wg.Go(func() {
			for k := 1; ; k++ {
				select {
				case <-p.done:
				case <-done:
					return
				}
				mu.Lock()
				kills = append(kills, p.exitAt)
				mu.Unlock()
				next := 0
				if k < inboxKillsEach {
					next = run.killAt(k, i)
				}
				select {
				case <-done:
					return
				default:
				}
				p = start(i, next)
				if next == 0 {
					return
				}
			}
		})
	}
	defer func() {
		// A replica that had not reached its kill when the backlog ran
		// out is stopped with the test; the loops start none after done.
		close(done)
		wg.Wait()
	}()

	count := func(sql string, args ...any) int {
		var n int
		if err := db.Pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	testkit.Eventually(t, 4*time.Minute, "every event applied", func() bool {
		return count(`SELECT count(DISTINCT event_id) FROM applied`) == run.events
	})
	testkit.Eventually(t, 30*time.Second, "no claim in progress", func() bool {
		return count(`SELECT count(*) FROM inbox_message WHERE finished_at IS NULL`) == 0
	})
	mu.Lock()
	killed := slices.Clone(kills)
	mu.Unlock()
	slices.SortFunc(killed, func(a, b time.Time) int { return a.Compare(b) })

	// The stall after a kill: from the kill to the next event applied by
	// anyone. A kill after the last event has none.
	var stalls []time.Duration
	for _, k := range killed {
		var next *time.Time
		if err := db.Pool.QueryRow(ctx, `SELECT min(at) FROM applied WHERE at > $1`, k).Scan(&next); err != nil {
			t.Fatal(err)
		}
		if next != nil {
			stalls = append(stalls, next.Sub(k).Round(10*time.Millisecond))
		}
	}
	doubled := count(`SELECT count(*) - count(DISTINCT event_id) FROM applied`)
	parked := count(`SELECT count(*) FROM inbox_message WHERE state = 'RECOVERY_REQUIRED'`)
	deadlocked := deadlocks(t, db) - deadlocksBefore
	t.Logf("%s: %d events, %d consumer kills after a commit; stall after each kill %v; %d doubled, %d parked, %d deadlocks",
		run.name, run.events, len(killed), stalls, doubled, parked, deadlocked)
	if doubled != 0 {
		t.Errorf("%d events applied twice", doubled)
	}
	if parked != 0 {
		t.Errorf("%d messages parked in RECOVERY_REQUIRED; a kill after the commit leaves nothing for an operator", parked)
	}
	if len(killed) < 2 {
		t.Fatalf("the consumers were killed %d times; the test proves nothing without kills", len(killed))
	}
	if deadlocked != 0 {
		t.Errorf("%d deadlocks in the database while the replicas claimed", deadlocked)
	}
	if worst := slices.Max(append(stalls, 0)); worst > run.maxStall {
		t.Errorf("a kill stopped the source for %s, want at most %s", worst, run.maxStall)
	}
	if run.ordered {
		if back := count(`SELECT count(*) FROM (SELECT seq < lag(seq) OVER (PARTITION BY aggregate ORDER BY n) AS back FROM applied) s WHERE back`); back != 0 {
			t.Errorf("%d events applied before an earlier event of their aggregate", back)
		}
	}
}

// deadlocks is the server's count of deadlocks in db's database so far.
func deadlocks(t *testing.T, db *pgtest.DB) int {
	t.Helper()
	var n int
	if err := db.Pool.QueryRow(t.Context(), `SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// publishBacklog publishes events to a new stream SHOP as the outbox's
// NATS sink would: CloudEvents headers, the aggregate as ce-subject, the
// event's sequence within its aggregate in the body.
func publishBacklog(t *testing.T, url string, events int) {
	t.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "SHOP", Subjects: []string{"shop.>"}}); err != nil {
		t.Fatal(err)
	}
	for i := range events {
		h := nats.Header{}
		h.Set("ce-specversion", "1.0")
		h.Set("ce-id", fmt.Sprintf("e-%d", i))
		h.Set("ce-source", "order")
		h.Set("ce-type", "order.step")
		h.Set("ce-subject", fmt.Sprintf("o-%d", i%inboxKillAggregates))
		body := fmt.Sprintf(`{"seq": %d}`, i/inboxKillAggregates)
		if _, err := js.PublishMsgAsync(&nats.Msg{Subject: "shop.order", Header: h, Data: []byte(body)}); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-ctx.Done():
		t.Fatal("the backlog was not acknowledged by the stream within a minute")
	}
}

// produceBacklog produces events to the topic shop as the outbox's Kafka
// sink would: CloudEvents headers, the aggregate as ce_subject and as the
// record key, the event's sequence within its aggregate in the value.
func produceBacklog(t *testing.T, brokers string, events int) {
	t.Helper()
	c, err := kgo.NewClient(kgo.SeedBrokers(strings.Split(brokers, ",")...), kgo.ProducerLinger(0))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	recs := make([]*kgo.Record, events)
	for i := range recs {
		aggregate := fmt.Sprintf("o-%d", i%inboxKillAggregates)
		recs[i] = &kgo.Record{Topic: "shop", Key: []byte("order:" + aggregate), Value: fmt.Appendf(nil, `{"seq": %d}`, i/inboxKillAggregates),
			Headers: []kgo.RecordHeader{
				{Key: "ce_specversion", Value: []byte("1.0")},
				{Key: "ce_id", Value: fmt.Appendf(nil, "e-%d", i)},
				{Key: "ce_source", Value: []byte("order")},
				{Key: "ce_type", Value: []byte("order.step")},
				{Key: "ce_subject", Value: []byte(aggregate)},
				{Key: "content-type", Value: []byte("application/json")},
			}}
	}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if err := c.ProduceSync(ctx, recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
}
