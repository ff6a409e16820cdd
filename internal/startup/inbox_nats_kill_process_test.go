package startup_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

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
	for _, mode := range []natsKillRun{
		// A commit is one message in ordered mode, a fetch of up to 100
		// otherwise; the counts restart with each process.
		{name: "ordered", maxAckPending: 1, events: 600, killAt: func(k, i int) int { return 40 + 20*k + 15*i }},
		{name: "unordered", maxAckPending: 1000, events: 5000, killAt: func(k, i int) int { return 2 + 2*k + i }},
	} {
		// One after the other: each runs two workers, and the machine is
		// shared.
		t.Run(mode.name, func(t *testing.T) { runNATSKills(t, mode) })
	}
}

type natsKillRun struct {
	name          string
	maxAckPending int
	events        int
	// killAt is the work commit after which consumer i kills itself the
	// k-th time.
	killAt func(k, i int) int
}

const (
	natsKillAggregates = 20
	natsKillsEach      = 3
	// natsMaxStall is the longest a kill may stop the stream: ack_wait's
	// default (5s), a restart, and slack for a loaded machine.
	natsMaxStall = 10 * time.Second
)

func runNATSKills(t *testing.T, run natsKillRun) {
	pgtest.Need(t, 2*inboxWorkerConns+pgtest.PoolConns)
	db := pgtest.New(t)
	ctx := t.Context()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE applied (
		n bigserial, event_id text NOT NULL, aggregate text NOT NULL, seq int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`); err != nil {
		t.Fatal(err)
	}
	srv := runNATS(t, &server.Options{Port: server.RANDOM_PORT, StoreDir: t.TempDir()})
	publishBacklog(t, srv.ClientURL(), run.events)

	cfg := writeConfig(t, fmt.Sprintf(`outbox: {enabled: false}
inbox:
  backoff_base: 10ms
  backoff_max: 100ms
  sources:
    - name: shop
      kind: nats
      nats: {url: %q, stream: SHOP, consumer: shop, create_consumer: true, max_ack_pending: %d}
      handler:
        kind: sql
        sql: INSERT INTO applied (event_id, aggregate, seq) VALUES (@id, @order_key, (@body_json::jsonb->>'seq')::int)
`, srv.ClientURL(), run.maxAckPending))
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
	for i := range 2 {
		p := start(i, run.killAt(0, i))
		wg.Go(func() {
			for k := 1; ; k++ {
				select {
				case <-p.done:
				case <-ctx.Done():
					return
				}
				if ctx.Err() != nil {
					return
				}
				mu.Lock()
				kills = append(kills, p.exitAt)
				mu.Unlock()
				next := 0
				if k < natsKillsEach {
					next = run.killAt(k, i)
				}
				p = start(i, next)
				if next == 0 {
					return
				}
			}
		})
	}

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
	t.Logf("%s: %d events, %d consumer kills after a commit; stall after each kill %v; %d doubled, %d parked",
		run.name, run.events, len(killed), stalls, doubled, parked)
	if doubled != 0 {
		t.Errorf("%d events applied twice", doubled)
	}
	if parked != 0 {
		t.Errorf("%d messages parked in RECOVERY_REQUIRED; a kill after the commit leaves nothing for an operator", parked)
	}
	if len(killed) < 2 {
		t.Fatalf("the consumers were killed %d times; the test proves nothing without kills", len(killed))
	}
	if worst := slices.Max(append(stalls, 0)); worst > natsMaxStall {
		t.Errorf("a kill stopped the stream for %s, want at most %s", worst, natsMaxStall)
	}
	if run.maxAckPending == 1 {
		if back := count(`SELECT count(*) FROM (SELECT seq < lag(seq) OVER (PARTITION BY aggregate ORDER BY n) AS back FROM applied) s WHERE back`); back != 0 {
			t.Errorf("%d events applied before an earlier event of their aggregate", back)
		}
	}
	wg.Wait()
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
		h.Set("ce-subject", fmt.Sprintf("o-%d", i%natsKillAggregates))
		body := fmt.Sprintf(`{"seq": %d}`, i/natsKillAggregates)
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
