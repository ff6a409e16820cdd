package startup_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/outbox/outboxtest"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// outageReceiver is a webhook endpoint that can be taken down (its port
// refuses connections) and brought back on the same address. It records the
// order in which each aggregate's events first arrived, and answers 500 to
// every event of the aggregate "poison".
type outageReceiver struct {
	addr string

	mu     sync.Mutex
	srv    *http.Server
	first  map[string][]int // aggregate -> event numbers, first arrivals in order
	seen   map[string]bool  // ce-id
	copies int              // deliveries of an event already seen
}

func newOutageReceiver(t *testing.T) *outageReceiver {
	r := &outageReceiver{addr: freeAddr(t), first: map[string][]int{}, seen: map[string]bool{}}
	r.up(t)
	t.Cleanup(r.down)
	return r
}

func (r *outageReceiver) up(t *testing.T) {
	t.Helper()
	var l net.Listener
	// The port was ours a moment ago; listening again can race its last
	// connections' teardown.
	testkit.Eventually(t, 5*time.Second, "the receiver's port to listen again", func() bool {
		var err error
		l, err = net.Listen("tcp", r.addr)
		return err == nil
	})
	srv := &http.Server{Handler: r, ReadHeaderTimeout: 5 * time.Second}
	r.mu.Lock()
	r.srv = srv
	r.mu.Unlock()
	go func() { _ = srv.Serve(l) }()
}

// down closes the listener and every connection: the relay sees refused
// and reset connections.
func (r *outageReceiver) down() {
	r.mu.Lock()
	srv := r.srv
	r.srv = nil
	r.mu.Unlock()
	if srv != nil {
		_ = srv.Close()
	}
}

func (r *outageReceiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	body, err := io.ReadAll(req.Body)
	var ev struct {
		A string `json:"a"`
		N int    `json:"n"`
	}
	if err != nil || json.Unmarshal(body, &ev) != nil {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	if ev.A == "poison" {
		http.Error(w, "cannot handle this order", http.StatusInternalServerError)
		return
	}
	id := req.Header.Get("Ce-Id")
	r.mu.Lock()
	if r.seen[id] {
		r.copies++
	} else {
		r.seen[id] = true
		r.first[ev.A] = append(r.first[ev.A], ev.N)
	}
	r.mu.Unlock()
	w.WriteHeader(http.StatusNoContent)
}

func (r *outageReceiver) distinct() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.seen)
}

// TestWebhookOutageHoldsEvents runs the worker against a webhook receiver
// that goes away for 3 s (WORKER_WEBHOOK_OUTAGE) while events arrive at 20/s over 10
// aggregates: no event goes DEAD or spends an attempt, outbox_sink_up reads
// 0 meanwhile, the outage is logged once when it starts and once when it
// ends, and every event that waited reaches the receiver within 10 s of its
// return, in per-aggregate order. A poison aggregate, answered 500, gets an
// event before, during and after the outage: each goes DEAD after
// max_attempts of its own failures.
func TestWebhookOutageHoldsEvents(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	outboxtest.RecordPublishes(t, db.Pool)
	recv := newOutageReceiver(t)
	w := startWorker(t, []string{
		"APP_DATABASE_URL=" + db.URL,
		"APP_TASKS_ENABLED=false",
		"APP_OUTBOX_SINK=webhook",
		"APP_OUTBOX_WEBHOOK_URL=http://" + recv.addr + "/events",
		"APP_OUTBOX_WEBHOOK_TIMEOUT=2s",
		"APP_OUTBOX_PROBE_BACKOFF_MAX=200ms",
		"APP_OUTBOX_MAX_ATTEMPTS=3",
		"APP_OUTBOX_BACKOFF_BASE=50ms",
		"APP_OUTBOX_BACKOFF_MAX=500ms",
	})
	w.waitReady(t, 30*time.Second)
	var poison []string
	addPoison := func() {
		var id string
		if err := db.Pool.QueryRow(context.Background(), `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
			VALUES ('order', 'poison', 'order.changed', '{"a": "poison"}') RETURNING event_id::text`).Scan(&id); err != nil {
			t.Fatal(err)
		}
		poison = append(poison, id)
	}
	addPoison()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	produced := make(chan int, 1)
	go func() {
		tick := time.NewTicker(50 * time.Millisecond) // 20 events/s
		defer tick.Stop()
		n := 0
		defer func() { produced <- n }()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			agg := fmt.Sprintf("agg-%d", n%10)
			_, err := db.Pool.Exec(context.Background(), `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
				VALUES ('order', $1, 'order.changed', jsonb_build_object('a', $1::text, 'n', $2::int))`, agg, n)
			if err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("insert: %v", err)
				return
			}
			n++
		}
	}()

	testkit.Eventually(t, 10*time.Second, "the first deliveries", func() bool { return recv.distinct() >= 20 })
	recv.down()
	testkit.Eventually(t, 10*time.Second, "outbox_sink_up 0 while the receiver is down", func() bool {
		_, m := w.get("/metrics")
		return strings.Contains(m, `outbox_sink_up{sink="webhook"} 0`)
	})
	addPoison()
	outage := 3 * time.Second
	if v := os.Getenv("WORKER_WEBHOOK_OUTAGE"); v != "" {
		// The 30 s and 120 s outages: WORKER_WEBHOOK_OUTAGE=120s.
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			t.Fatalf("WORKER_WEBHOOK_OUTAGE=%q: want a positive duration", v)
		}
		outage = d
	}
	outageEnds := time.Now().Add(outage)
	testkit.Eventually(t, outage+10*time.Second, "the outage to last", func() bool { return time.Now().After(outageEnds) })
	recv.up(t)
	back := time.Now()
	addPoison()
	cancel()
	total := <-produced

	testkit.Eventually(t, 10*time.Second, "every event to reach the receiver", func() bool { return recv.distinct() == total })
	t.Logf("%d events, receiver down %s; caught up %s after it came back", total, outage, time.Since(back).Round(time.Millisecond))
	testkit.Eventually(t, 10*time.Second, "every event marked PUBLISHED", func() bool {
		var n int
		err := db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_event_state WHERE status = 'PUBLISHED'`).Scan(&n)
		return err == nil && n == total
	})
	testkit.Eventually(t, 10*time.Second, "every poison event DEAD after 3 attempts", func() bool {
		var n int
		err := db.Pool.QueryRow(context.Background(),
			`SELECT count(*) FROM outbox_event_state WHERE event_id = ANY($1::uuid[]) AND status = 'DEAD' AND attempts = 3`, poison).Scan(&n)
		return err == nil && n == len(poison)
	})

	var dead int
	if err := db.Pool.QueryRow(context.Background(),
		`SELECT count(*) FROM outbox_event_state WHERE status = 'DEAD' AND aggregate_id <> 'poison'`).Scan(&dead); err != nil {
		t.Fatal(err)
	}
	if dead != 0 {
		t.Errorf("%d events DEAD; want none", dead)
	}
	checkNoAttemptSpent(t, db, "aggregate_id <> 'poison'", total)
	recv.mu.Lock()
	for agg, ns := range recv.first {
		for i := 1; i < len(ns); i++ {
			if ns[i] < ns[i-1] {
				t.Errorf("aggregate %s: event %d arrived after event %d", agg, ns[i], ns[i-1])
			}
		}
	}
	// Only an event whose answer the outage cut can arrive twice.
	if recv.copies > 64 {
		t.Errorf("%d duplicate deliveries, more than max_in_flight publishes could have been cut", recv.copies)
	}
	recv.mu.Unlock()
	testkit.Eventually(t, 5*time.Second, "outbox_sink_up 1", func() bool {
		_, m := w.get("/metrics")
		return strings.Contains(m, `outbox_sink_up{sink="webhook"} 1`)
	})
	out := w.out.String()
	if n := strings.Count(out, `"msg":"outbox sink unavailable;`); n != 1 {
		t.Errorf("%d breaker-open log lines, want 1", n)
	}
	if n := strings.Count(out, `"msg":"outbox sink available again; claiming resumes"`); n != 1 {
		t.Errorf("%d breaker-close log lines, want 1", n)
	}
	// The poison's own failures, none for the outage: each poison event
	// fails twice before the third attempt sends it DEAD.
	if n := strings.Count(out, `"msg":"outbox publish failed; retry scheduled"`); n != 2*len(poison) {
		t.Errorf("%d per-event failure lines, want %d: the poison's own, none for the outage", n, 2*len(poison))
	}
}
