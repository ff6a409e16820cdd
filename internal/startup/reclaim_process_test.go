package startup_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/outbox/outboxtest"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// slowReceiver is a webhook endpoint that answers each request after
// latency, so the relays detach their publishes. It records when each
// event arrived and, per aggregate, the order of first arrivals.
type slowReceiver struct {
	url     string
	latency time.Duration

	mu      sync.Mutex
	arrived map[string][]time.Time // ce-id -> arrivals
	first   map[string][]int       // aggregate -> event numbers, first arrivals in order
	firstAt map[string][]time.Time // aggregate -> when each of first arrived
}

func newSlowReceiver(t *testing.T, latency time.Duration) *slowReceiver {
	r := &slowReceiver{latency: latency, arrived: map[string][]time.Time{}, first: map[string][]int{}, firstAt: map[string][]time.Time{}}
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close) // registered before the workers start, so it runs after they are killed
	r.url = srv.URL
	return r
}

func (r *slowReceiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	at := time.Now()
	body, err := io.ReadAll(req.Body)
	var ev struct {
		A string `json:"a"`
		N int    `json:"n"`
	}
	if err != nil || json.Unmarshal(body, &ev) != nil {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	id := req.Header.Get("Ce-Id")
	r.mu.Lock()
	if len(r.arrived[id]) == 0 {
		r.first[ev.A] = append(r.first[ev.A], ev.N)
		r.firstAt[ev.A] = append(r.firstAt[ev.A], at)
	}
	r.arrived[id] = append(r.arrived[id], at)
	r.mu.Unlock()
	time.Sleep(r.latency) // the receiver's answer time
	w.WriteHeader(http.StatusNoContent)
}

const (
	reclaimAggregates = 40
	reclaimPerAgg     = 16
	// reclaimReplicaConns is what one replica may hold (Config.MaxDBConns):
	// its pool of 3, the readiness probe's, the outbox listener, and the
	// lease pool of 2 with its listener.
	reclaimReplicaConns = 8
)

// TestKilledReplicasDetachedEventsReclaimedAtOnce: two replicas
// (multi-instance) publish to a webhook receiver that answers in 250 ms, so
// every publish is detached (detach_after 50ms) and the events are
// IN_FLIGHT while it is out. One replica is SIGKILLed while it holds such
// events. in_flight_timeout stays at its default, 30s, yet the other
// replica publishes every held event within 2 s of the kill, because the
// killed replica's marker session ended with it; it logs the reclaim once.
// No event is lost, and no aggregate's events arrive out of order for the
// first time (an event may arrive twice: at least once).
func TestKilledReplicasDetachedEventsReclaimedAtOnce(t *testing.T) {
	t.Parallel()
	pgtest.Need(t, 2*reclaimReplicaConns+pgtest.PoolConns)
	db := pgtest.New(t)
	outboxtest.RecordPublishes(t, db.Pool)
	ctx := context.Background()
	recv := newSlowReceiver(t, 250*time.Millisecond)
	env := []string{
		"APP_DATABASE_URL=" + db.URL, "APP_LOG_LEVEL=info",
		"APP_MULTI_INSTANCE_ENABLED=true", "APP_LOCK_PROVIDER=postgres",
		"APP_TASKS_ENABLED=false", "APP_DATABASE_MAX_CONNS=3",
		"APP_OUTBOX_SINK=webhook", "APP_OUTBOX_WEBHOOK_URL=" + recv.url,
		"APP_OUTBOX_DETACH_AFTER=50ms", // in_flight_timeout: the default 30s
	}
	if n := workerConns(env, nil); n != reclaimReplicaConns {
		t.Fatalf("a replica may hold %d connections, want reclaimReplicaConns = %d", n, reclaimReplicaConns)
	}
	replicas := map[string]*proc{}
	for _, id := range []string{"replica-a", "replica-b"} {
		replicas[id] = startWorker(t, append(env, "APP_INSTANCE_ID="+id))
	}
	for _, p := range replicas {
		p.waitReady(t, 60*time.Second)
	}
	// A replica reclaims only for a marker it saw held (the class is the
	// markers' advisory lock class, outbox's markerLockClass): wait until
	// both listeners looked at the markers since both were held.
	var bothHeld time.Time
	testkit.Eventually(t, 30*time.Second, "both replicas' markers held", atMostEvery(20*time.Millisecond, func() bool {
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(DISTINCT objid), clock_timestamp() FROM pg_locks
			WHERE locktype = 'advisory' AND classid = 7304565 AND objsubid = 2 AND granted
			AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`).Scan(&n, &bothHeld); err != nil {
			t.Fatal(err)
		}
		return n == 2
	}))
	testkit.Eventually(t, 30*time.Second, "both listeners to look at the markers", atMostEvery(20*time.Millisecond, func() bool {
		var n int
		if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND application_name = 'outbox-listener' AND state = 'idle' AND query LIKE '%pg_locks%' AND query_start > $1`,
			bothHeld).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 2
	}))
	if _, err := db.Pool.Exec(ctx, `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
		SELECT 'order', 'agg-' || a, 'order.updated', jsonb_build_object('a', 'agg-' || a, 'n', n)
		FROM generate_series(0, $2 - 1) n, generate_series(0, $1 - 1) a ORDER BY n, a`,
		reclaimAggregates, reclaimPerAgg); err != nil {
		t.Fatal(err)
	}
	count := func(sql string, args ...any) (n int) {
		t.Helper()
		if err := db.Pool.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	// Kill replica-a while it holds detached publishes.
	testkit.Eventually(t, 30*time.Second, "replica-a to hold detached publishes", atMostEvery(20*time.Millisecond, func() bool {
		return count(`SELECT count(*) FROM outbox_event_state WHERE status = 'IN_FLIGHT' AND claimed_by LIKE 'replica-a/%'`) >= 5
	}))
	a := replicas["replica-a"]
	if err := a.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	a.exitCode(t, 10*time.Second)
	// What it held at the kill: nobody else touches its rows before they
	// are reclaimed.
	rows, err := db.Pool.Query(ctx, `SELECT event_id::text, claimed_by, next_attempt_at FROM outbox_event_state
		WHERE status = 'IN_FLIGHT' AND claimed_by LIKE 'replica-a/%'`)
	if err != nil {
		t.Fatal(err)
	}
	var held []string
	var deadline time.Time
	for rows.Next() {
		var id, claimedBy string
		if err := rows.Scan(&id, &claimedBy, &deadline); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(claimedBy, "@") {
			t.Errorf("event %s held as %q names no marker: it would wait for in_flight_timeout", id, claimedBy)
		}
		held = append(held, id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(held) == 0 {
		t.Fatal("replica-a held no IN_FLIGHT events when it was killed")
	}

	// replica-b publishes them again, well before their deadline. Every
	// publish is detached, so the delivery row is deleted by the completion
	// of replica-b's own publish, which names replica-b's claim.
	testkit.Eventually(t, 20*time.Second, "replica-b to publish the held events", atMostEvery(10*time.Millisecond, func() bool {
		return count(`SELECT count(*) FROM test_publish p JOIN outbox_event e ON e.id = p.id
			WHERE e.event_id::text = ANY($1) AND p.claimed_by LIKE 'replica-b/%'`, held) == len(held)
	}))
	published := time.Since(killed)
	var resent time.Duration // the last held event's arrival at the receiver after the kill
	recv.mu.Lock()
	for _, id := range held {
		for _, at := range recv.arrived[id] {
			if at.After(killed) {
				resent = max(resent, at.Sub(killed))
			}
		}
	}
	recv.mu.Unlock()
	t.Logf("replica-a held %d events at the kill (deadline %s away); replica-b sent the last of them %s after the kill, all PUBLISHED after %s",
		len(held), time.Until(deadline).Round(time.Second), resent.Round(time.Millisecond), published.Round(time.Millisecond))
	if published > 2*time.Second {
		t.Errorf("the held events were PUBLISHED %s after the kill, want within 2s", published)
	}
	reclaims := replicas["replica-b"].out.Lines(t, "outbox relay gone; its detached events reclaimed")
	if len(reclaims) != 1 || reclaims[0]["owner"] != "replica-a" || fmt.Sprint(reclaims[0]["events"]) != fmt.Sprint(len(held)) {
		t.Errorf("want one reclaim line from replica-b, owner replica-a, events %d; got %v", len(held), reclaims)
	}

	// Nothing lost, nothing reordered.
	total := reclaimAggregates * reclaimPerAgg
	testkit.Eventually(t, 60*time.Second, "every event PUBLISHED", atMostEvery(100*time.Millisecond, func() bool {
		return count(`SELECT count(*) FROM outbox_event_state WHERE status = 'PUBLISHED'`) == total
	}))
	recv.mu.Lock()
	defer recv.mu.Unlock()
	if len(recv.arrived) != total {
		t.Errorf("%d distinct events reached the receiver, want %d", len(recv.arrived), total)
	}
	dups := 0
	for _, at := range recv.arrived {
		dups += len(at) - 1
	}
	for agg, got := range recv.first {
		for i, n := range got {
			if n != i {
				t.Errorf("%s: first arrivals out of order: %v", agg, got)
				break
			}
		}
	}
	t.Logf("%d events over %d aggregates, every one delivered, in order; %d delivered twice", total, reclaimAggregates, dups)
}
